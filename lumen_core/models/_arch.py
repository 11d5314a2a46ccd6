"""What differs between the encoder families the importer builds, read from ``config.json``.

:func:`encoder_spec` turns a Hugging Face config into an :class:`EncoderSpec` (sizes,
activation, where the usable position table starts and how long it is), and
:func:`canonical_weights` renames a checkpoint's tensors to BERT's names, so
:mod:`._graph` has one encoder to write.  Problems raise :class:`ArchError` (the importer
turns it into a ``ModelImportError`` naming the folder and file).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from ._graph import ACTIVATIONS

#: config.json ``model_type`` -> family (the TextModel's ``architecture``)
FAMILIES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "xlm-roberta",
            "camembert": "roberta", "mpnet": "mpnet", "distilbert": "distilbert",
            "modernbert": "modernbert"}
#: config.json ``architectures`` the importer builds: encoders (embed) ...
ENCODERS = ("BertModel", "RobertaModel", "XLMRobertaModel", "CamembertModel", "MPNetModel",
            "DistilBertModel", "ModernBertModel")
#: ... and one-label sequence classifiers (rerank: sentence-transformers' CrossEncoder)
CLASSIFIERS = ("BertForSequenceClassification", "RobertaForSequenceClassification",
               "XLMRobertaForSequenceClassification")
#: checkpoints saved from a pre-training head keep the encoder under a prefix
_PREFIXES = ("bert.", "roberta.", "mpnet.", "distilbert.", "model.", "xlm_roberta.", "camembert.")
#: MPNet's relative position buckets (``compute_position_bias``'s defaults, not the config's)
MPNET_BUCKETS = 32
MPNET_MAX_DISTANCE = 128
#: DistilBERT's LayerNorms (hard-coded in transformers)
DISTILBERT_EPS = 1e-12


class ArchError(ValueError):
    """``problem`` with ``file`` of the folder (config.json or the weights)."""

    def __init__(self, file: str, problem: str) -> None:
        super().__init__(problem)
        self.file = file
        self.problem = problem


@dataclasses.dataclass
class EncoderSpec:
    family: str
    hidden: int
    heads: int
    layers: int
    eps: float
    activation: str
    vocab_size: int
    #: first row of the position table a right-padded row's token 0 reads (RoBERTa: pad + 1)
    position_offset: int
    #: usable positions: the longest input the graph accepts
    max_positions: int
    pad_token_id: int
    #: cross-encoders with token types: the separator id after which types are 1
    pair_separator: Optional[int] = None
    #: MPNet: [2 * max_positions - 1, heads] bias per relative distance (set from the weights)
    relative_bias: Optional[np.ndarray] = None


def _int(config: dict, key: str, default: Any = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArchError("config.json", f"{key!r} must be an integer, got {value!r}")
    return value


def family_of(config: dict) -> str:
    """The family of a config.json, or ArchError naming what it is."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        archs = config.get("architectures") or [model_type]
        raise ArchError("config.json", f"model_type {model_type!r} ({', '.join(map(str, archs))}) "
                                       "is not supported")
    return FAMILIES[model_type]


def encoder_spec(config: dict) -> EncoderSpec:
    """The encoder's shape from ``config``; ArchError for what the graph cannot express."""
    family = family_of(config)
    if family == "distilbert":
        hidden, heads = _int(config, "dim"), _int(config, "n_heads")
        layers, act, eps = _int(config, "n_layers"), config.get("activation", "gelu"), DISTILBERT_EPS
    else:
        hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
        layers = _int(config, "num_hidden_layers")
        act = config.get("hidden_activation" if family == "modernbert" else "hidden_act", "gelu")
        eps = float(config.get("layer_norm_eps", 1e-12))
        kind = config.get("position_embedding_type", "absolute")
        if kind not in (None, "absolute"):
            raise ArchError("config.json", f"position_embedding_type {kind!r} is not supported "
                                           "(only 'absolute')")
    if act not in ACTIVATIONS:
        raise ArchError("config.json", f"activation {act!r} is not supported "
                                       f"({', '.join(ACTIVATIONS)})")
    if hidden % heads:
        raise ArchError("config.json", f"hidden size {hidden} is not a multiple of {heads} heads")
    positions = _int(config, "max_position_embeddings", 512)
    pad = _int(config, "pad_token_id", 1 if family in ("roberta", "xlm-roberta", "mpnet") else 0)
    offset = pad + 1 if family in ("roberta", "xlm-roberta", "mpnet") else 0
    if positions - offset < 2:
        raise ArchError("config.json", f"max_position_embeddings {positions} leaves no positions "
                                       f"after the padding offset {offset}")
    return EncoderSpec(family=family, hidden=hidden, heads=heads, layers=layers, eps=eps,
                       activation=str(act), vocab_size=_int(config, "vocab_size"),
                       position_offset=offset, max_positions=positions - offset, pad_token_id=pad)


def _strip_prefix(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if "embeddings.word_embeddings.weight" in weights:
        return weights
    for prefix in _PREFIXES:
        if prefix + "embeddings.word_embeddings.weight" in weights:
            return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    raise ArchError("model.safetensors", "no embeddings.word_embeddings.weight tensor (under any of "
                                         f"the prefixes {', '.join(p.rstrip('.') for p in _PREFIXES)})")


_DISTILBERT = {"attention.q_lin": "attention.self.query", "attention.k_lin": "attention.self.key",
               "attention.v_lin": "attention.self.value", "attention.out_lin": "attention.output.dense",
               "sa_layer_norm": "attention.output.LayerNorm", "ffn.lin1": "intermediate.dense",
               "ffn.lin2": "output.dense", "output_layer_norm": "output.LayerNorm"}
_MPNET = {"attention.attn.q": "attention.self.query", "attention.attn.k": "attention.self.key",
          "attention.attn.v": "attention.self.value", "attention.attn.o": "attention.output.dense",
          "attention.LayerNorm": "attention.output.LayerNorm"}


def _rename_layers(w: dict[str, np.ndarray], prefix: str, stems: dict[str, str]) -> dict[str, np.ndarray]:
    """``<prefix><i>.<stem>.<leaf>`` -> ``encoder.layer.<i>.<BERT's stem>.<leaf>``."""
    renamed = {}
    for k, v in w.items():
        if k.startswith(prefix):
            idx, rest = k[len(prefix):].split(".", 1)
            stem, leaf = rest.rsplit(".", 1)
            k = f"encoder.layer.{idx}.{stems.get(stem, stem)}.{leaf}"
        renamed[k] = v
    return renamed


def canonical_weights(weights: dict[str, np.ndarray], spec: EncoderSpec) -> dict[str, np.ndarray]:
    """The encoder's tensors under BERT's names (``embeddings.*``, ``encoder.layer.i.*``);
    for MPNet also sets ``spec.relative_bias``.  ArchError naming the first missing tensor."""
    w = {k.replace(".gamma", ".weight").replace(".beta", ".bias"): v
         for k, v in _strip_prefix(weights).items()}
    if spec.family == "distilbert":
        w = _rename_layers(w, "transformer.layer.", _DISTILBERT)
    elif spec.family == "mpnet":
        w = _rename_layers(w, "encoder.layer.", _MPNET)
        table = w.get("encoder.relative_attention_bias.weight")
        if table is None:
            raise ArchError("model.safetensors", "MPNet without encoder.relative_attention_bias.weight")
        spec.relative_bias = mpnet_bias_table(np.asarray(table, np.float32), spec.max_positions)
    need = ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
            "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"]
    for i in range(spec.layers):
        p = f"encoder.layer.{i}."
        for stem in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
                     "output.dense", "output.LayerNorm"):
            need += [p + stem + ".weight", p + stem + ".bias"]
    missing = [k for k in need if k not in w]
    if missing:
        raise ArchError("model.safetensors", f"{spec.family} tensor {missing[0]!r} is missing "
                                             f"({len(missing)} of {len(need)} missing)")
    rows, width = w["embeddings.word_embeddings.weight"].shape
    if width != spec.hidden or rows != spec.vocab_size:
        raise ArchError("model.safetensors", f"word embeddings are {rows}x{width}, config.json says "
                                             f"{spec.vocab_size}x{spec.hidden}")
    if len(w["embeddings.position_embeddings.weight"]) < spec.position_offset + spec.max_positions:
        raise ArchError("model.safetensors", "the position table is shorter than "
                                             "max_position_embeddings")
    return {k: np.asarray(v, dtype=np.float32) for k, v in w.items()}


def mpnet_bias_table(embedding: np.ndarray, span: int) -> np.ndarray:
    """[2 * span - 1, heads]: row ``d + span - 1`` is the bias of key - query distance ``d``,
    bucketed as transformers' ``MPNetEncoder.relative_position_bucket`` does (in fp32, as
    torch computes the logarithm)."""
    rel = np.arange(-(span - 1), span, dtype=np.int64)
    n = -rel
    half = MPNET_BUCKETS // 2
    ret = (n < 0).astype(np.int64) * half
    n = np.abs(n)
    max_exact = half // 2
    with np.errstate(divide="ignore"):
        scaled = (np.log(n.astype(np.float32) / np.float32(max_exact))
                  / np.float32(np.log(MPNET_MAX_DISTANCE / max_exact)) * np.float32(half - max_exact))
    large = max_exact + np.where(np.isfinite(scaled), scaled, 0).astype(np.int64)
    large = np.minimum(large, half - 1)
    ret = ret + np.where(n < max_exact, n, large)
    return embedding[ret]


def classifier_weights(weights: dict[str, np.ndarray], family: str) -> dict[str, np.ndarray]:
    """A one-label sequence classifier's head: BERT ``pooler`` (dense + tanh on [CLS]) and
    ``classifier``; RoBERTa/XLM-R ``classifier.dense`` (+ tanh) and ``classifier.out_proj``."""
    if family == "bert":
        names = {"dense.weight": ("bert.pooler.dense.weight", "pooler.dense.weight"),
                 "dense.bias": ("bert.pooler.dense.bias", "pooler.dense.bias"),
                 "out.weight": ("classifier.weight",), "out.bias": ("classifier.bias",)}
    else:
        names = {"dense.weight": ("classifier.dense.weight",), "dense.bias": ("classifier.dense.bias",),
                 "out.weight": ("classifier.out_proj.weight",), "out.bias": ("classifier.out_proj.bias",)}
    head = {}
    for key, options in names.items():
        found = next((weights[o] for o in options if o in weights), None)
        if found is None:
            raise ArchError("model.safetensors", f"the classifier tensor {options[0]!r} is missing")
        head[key] = np.asarray(found, dtype=np.float32)
    return head
