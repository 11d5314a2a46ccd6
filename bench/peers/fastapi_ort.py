"""Per-request FastAPI + ONNX Runtime baseline: what a service team writes first.

One text per request, tokenised and run on its own (``[1, L]``, no batching), in FastAPI's
thread pool (a plain ``def`` endpoint), on the same prepared ONNX model as lumen's text_embed
(``$LUMEN_HOME/models/all-minilm-l6-v2``: mean pooling + L2 normalisation inside the graph) and
the same ORT thread settings.  OpenAI-style ``POST /v1/embeddings`` so ``lumen bench`` drives it
like every other target.

It runs from its own virtualenv (FastAPI is no dependency of lumen), e.g. the infinity one::

    /work/infvenv/bin/python bench/peers/fastapi_ort.py --model-dir ~/.cache/lumen/models/all-minilm-l6-v2 \\
        --port 8101 --threads 2
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from tokenizers import Tokenizer

MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's sentence-transformers setting


class EmbeddingsRequest(BaseModel):
    model: str = ""
    input: str | list[str]
    encoding_format: str = "float"


def build_app(model_dir: str, threads: int, spinning: bool) -> FastAPI:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    sess = ort.InferenceSession(os.path.join(model_dir, "model.onnx"), sess_options=opts,
                                providers=["CPUExecutionProvider"])
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.enable_truncation(MAX_SEQ_LENGTH)
    tok.no_padding()
    out_name = sess.get_outputs()[0].name
    app = FastAPI()

    def embed_one(text: str) -> list:
        ids = np.asarray([tok.encode(text).ids], dtype=np.int64)
        vec = sess.run([out_name], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][0]
        return vec.tolist()

    @app.post("/v1/embeddings")
    def embeddings(req: EmbeddingsRequest) -> dict:
        texts = [req.input] if isinstance(req.input, str) else req.input
        data = [{"object": "embedding", "index": i, "embedding": embed_one(t)}
                for i, t in enumerate(texts)]
        return {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": 0, "total_tokens": 0}}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8101)
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    ap.add_argument("--spinning", action="store_true", help="let ORT threads spin")
    args = ap.parse_args()
    app = build_app(args.model_dir, args.threads, args.spinning)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
