"""``image_embedding`` backend (task ``image_embed``): any CLIP-style vision encoder, three routes.

Routes (SPEC sections 2 and 5), all ending in the same fp32 ``[N, 3, 224, 224]`` model input:

* **raw** ``image/jpeg`` / ``image/png`` / ``image/webp``: decoded with Pillow (EXIF
  orientation, RGB conversion, header-only pixel limit, forced load so truncated or lying files
  fail here) and bicubic-resized + centre-cropped by :mod:`lumen_core.tasks.imaging`.  This
  runs off the event loop (``prepare_off_loop``).  The prepared item is the uint8 224x224x3
  crop; the rest of ``clip_image_openai_v1`` (scale, mean/std, HWC -> CHW) is the fused
  compiled pass, run by the :class:`~lumen_core.engine.plan.ImageInput` plan straight into the
  request's slot of the batch buffer;
* **fp32 tensor** ``[1,3,224,224]`` ``NCHW`` ``clip_image_openai_v1``: the client normalised;
  the payload is memcpy'd into its slot;
* **uint8 tensor** ``[1,224,224,3]`` ``NHWC`` ``clip_image_openai_v1_uint8``: the client
  resized and cropped; the payload (viewed without a copy) goes through the same fused pass as
  a raw image.  4x fewer bytes on the wire than fp32, and no normalisation on the client.

Execution signatures.  A signature is (task, model id, model version, model input dtype,
per-item shape, layout, preprocess id), always describing the *model input* (fp32 CHW), never
the wire format.  A raw request applies the whole ``clip_image_openai_v1`` recipe server-side,
so it carries that id and batches with fp32 tensors of that id: the response meta
``lumen.batch.size`` shows batches larger than either route alone could fill.

May a uint8 request share a batch with them?  Technically yes: after assembly its slot holds
exactly what a raw request's slot holds (same kernel, same lookup table), and the plan already
assembles mixed uint8/fp32 batches (raw + fp32).  Merging would fill batches faster under mixed
traffic.  We keep them apart anyway, as the issue and SPEC section 3 require, because the
preprocess id is a *semantic contract*, not a storage detail: ``_uint8`` says the geometry
(resampler, crop) was done by the client, whose resize implementation we cannot verify, so the
two ids promise different things about the pixels even though they share a normalisation.  A
signature that is a pure function of the declared contract also keeps a future change to one
recipe (another resampler tolerance, a different normalisation) from silently merging batches
of differently prepared inputs, and keeps per-id batch metrics attributable.  The cost is
confined to mixed traffic at low load; merging is a one-line change of ``_sig_uint8`` should the
product decide otherwise.

Configuration (no default CLIP model ships in a PyPI package here, so ``image_embed`` is not
one of ``Runtime.default()``'s tasks; configure it explicitly)::

    [[tasks]]
    name = "image_embed"
    backend = "image_embedding"
    model = "clip_vision.onnx"      # input [N,3,224,224] fp32 (N symbolic)
    [tasks.options]
    preprocess_id = "clip_image_openai_v1"   # the recipe; the only one known today
    output = "image_embeds"         # model output returned as `embedding` (needed if several)
    normalize = true                # L2-normalise the embedding
    max_image_pixels = 50000000     # decompression-bomb limit (decoded and resized pixels)

Output: ``embedding`` fp32 ``[D]``; a non-finite value is an ``internal`` error for that request.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from PIL import Image

from ..batching.signature import signature
from ..config import Option, TaskConfig
from ..contract import TensorContract, TensorSpec
from ..engine.plan import ImageInput, ModelSpec, OutputSpec, PreparedModelRequest
from ..engine.session import read_io
from ..errors import ConfigError, InternalError
from ..request import InferRequest, new_infer_request
from ..request_path.descriptor import Descriptor
from .base import TaskBackend, split_outputs
from .imaging import (
    CLIP_MEAN,
    CLIP_PREPROCESS_ID,
    CLIP_SIZE,
    CLIP_STD,
    CLIP_UINT8_PREPROCESS_ID,
    MIME_FORMATS,
    decode_image,
    resize_center_crop,
)

#: name of the returned output
OUTPUT_NAME = "embedding"
#: default decompression-bomb limit: 50 MP (a 150 MB RGB image) covers phone cameras up to
#: ~8000x6000 while bounding what one decoding thread may hold
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
#: smallest norm an embedding is divided by (an all-zero embedding stays zero, not NaN)
NORM_EPS = 1e-12
#: side of the grey picture the raw-route warm-up decodes
WARMUP_IMAGE_SIDE = 256
CHANNELS = 3


@dataclass(frozen=True)
class Recipe:
    """A preprocessing recipe: its id, the id of its uint8 (client-cropped) variant, constants."""

    preprocess_id: str
    uint8_id: str
    mean: tuple
    std: tuple
    size: int


#: known recipes, by ``options.preprocess_id``
RECIPES = {
    CLIP_PREPROCESS_ID: Recipe(CLIP_PREPROCESS_ID, CLIP_UINT8_PREPROCESS_ID, CLIP_MEAN, CLIP_STD,
                               CLIP_SIZE),
}


class ImageEmbeddingBackend(TaskBackend):
    raw_mimes = tuple(MIME_FORMATS)
    prepare_off_loop = True  # decode + resize: milliseconds of CPU per image
    options_schema = (
        Option("preprocess_id", str, CLIP_PREPROCESS_ID, "the preprocessing recipe",
               choices=tuple(sorted(RECIPES))),
        Option("output", str, None, "the model output returned as 'embedding'; needed when "
                                    "the model has several"),
        Option("normalize", bool, True, "L2-normalise the embedding"),
        Option("max_image_pixels", int, DEFAULT_MAX_IMAGE_PIXELS,
               "decompression-bomb limit on decoded and resized pixels", lo=1),
    )

    def __init__(self, config: TaskConfig):
        super().__init__(config)
        self.recipe = RECIPES[self.options["preprocess_id"]]
        self.max_pixels: int = self.options["max_image_pixels"]
        self.normalize: bool = self.options["normalize"]
        self.output_name: str = self.options["output"] or ""
        self.model_id = ""

    def load(self) -> ModelSpec:
        cfg = self.config
        src, key = cfg.source, cfg.key
        if not cfg.model:
            raise ConfigError(src, f"{key}.model", "is required for backend 'image_embedding' "
                                                   "(a CLIP-style vision encoder ONNX)")
        if not os.path.isfile(cfg.model):
            raise ConfigError(src, f"{key}.model", f"no such file: {cfg.model}")
        inputs, outputs = read_io(cfg.model)
        size = self.recipe.size
        if len(inputs) != 1:
            raise ConfigError(src, f"{key}.model", f"an image encoder has one input; {cfg.model} "
                                                   f"has {[i[0] for i in inputs]}")
        in_name, dtype, dims = inputs[0]
        want = (CHANNELS, size, size)
        if (dtype != "fp32" or len(dims) != 4
                or any(d is not None and d != w for d, w in zip(dims[1:], want, strict=True))):
            raise ConfigError(src, f"{key}.model", f"input {in_name!r} must be fp32 "
                                                   f"[N,{CHANNELS},{size},{size}], got {dtype} {list(dims)}")
        if dims[0] is not None and (dims[0] != 1 or cfg.batching.max_batch_size != 1):
            raise ConfigError(src, f"{key}.model", f"input {in_name!r} has a fixed batch size "
                                                   f"{dims[0]}; export the model with a dynamic batch axis "
                                                   f"(or use a batch-1 model with batching.max_batch_size = 1)")
        self.output_name = self._pick_output(outputs)
        odims = next(d for n, _, d in outputs if n == self.output_name)
        item = (odims[1],) if len(odims) == 2 and odims[1] is not None else None
        self._out_dims = [odims[1] if len(odims) == 2 else None]
        self.model_id = cfg.model_id or os.path.splitext(os.path.basename(cfg.model))[0]
        r = self.recipe
        self.contract = TensorContract(
            specs=(TensorSpec("fp32", "NCHW", frozenset({r.preprocess_id}),
                              ((1, 1), (CHANNELS, CHANNELS), (size, size), (size, size))),
                   TensorSpec("uint8", "NHWC", frozenset({r.uint8_id}),
                              ((1, 1), (size, size), (size, size), (CHANNELS, CHANNELS)))),
            model_id=self.model_id, model_version=cfg.model_version,
            raw_preprocess_ids=frozenset({r.preprocess_id}))
        item_shape = (CHANNELS, size, size)
        base = (self.name, self.model_id, cfg.model_version, "fp32", item_shape, "NCHW")
        self._item_shape = item_shape
        self._sig = signature(*base, r.preprocess_id)
        self._sig_uint8 = signature(*base, r.uint8_id)
        self.model = ModelSpec(
            cfg.model,
            [ImageInput(in_name, tuple(r.mean), tuple(r.std), size, size)],
            [OutputSpec(self.output_name, np.float32, item)])
        return self.model

    def _pick_output(self, outputs: list) -> str:
        cfg = self.config
        src, key = cfg.source, cfg.key
        names = [n for n, _, _ in outputs]
        if self.output_name:
            if self.output_name not in names:
                raise ConfigError(src, f"{key}.options.output", f"model {cfg.model} has no output "
                                                                f"{self.output_name!r}; it has {names}")
            name = self.output_name
        elif len(names) == 1:
            name = names[0]
        else:
            raise ConfigError(src, f"{key}.options.output", f"model {cfg.model} has outputs {names}; "
                                                            f"name the one to return as {OUTPUT_NAME!r}")
        _, odt, odims = next(o for o in outputs if o[0] == name)
        if odt != "fp32" or (odims and len(odims) != 2):
            raise ConfigError(src, f"{key}.options.output", f"output {name!r} must be fp32 [N, D] "
                                                            f"(an embedding per image), got {odt} {list(odims)}")
        return name

    # -- request path -----------------------------------------------------------------------
    def prepare_raw(self, req: InferRequest, desc: Descriptor, payload: memoryview, mime: str,
                    params: dict) -> PreparedModelRequest:
        """Decode + resize + crop (in a worker thread); normalisation happens in assembly."""
        size = self.recipe.size
        # a bytes payload is read in place by Pillow; any other buffer is copied once there
        src = req.payload if isinstance(req.payload, bytes) else payload
        hwc = resize_center_crop(decode_image(src, mime, self.max_pixels, size), size)
        return PreparedModelRequest(self._sig, (hwc,), self._item_shape)

    def prepare_tensor(self, req: InferRequest, desc: Descriptor,
                       payload: memoryview) -> PreparedModelRequest:
        """The descriptor is already validated against the contract (dtype, shape, layout, id)."""
        if desc.preprocess_id == self.recipe.uint8_id:
            size = self.recipe.size
            hwc = np.frombuffer(payload, dtype=np.uint8).reshape(size, size, CHANNELS)
            return PreparedModelRequest(self._sig_uint8, (hwc,), self._item_shape)
        return PreparedModelRequest(self._sig, (payload,), self._item_shape)

    def postprocess(self, outputs: dict, items: Sequence[PreparedModelRequest]) -> list:
        """L2-normalise (unless configured off), then per-item views; non-finite -> internal."""
        n = len(items)
        emb = outputs[self.output_name]
        if emb.ndim != 2 or emb.shape[0] < n:
            err = InternalError(f"model output {self.output_name!r} has shape {list(emb.shape)}; "
                                f"expected [{n}, D]")
            return [err] * n
        emb = emb[:n]
        if self.normalize:
            with np.errstate(all="ignore"):
                norms = np.sqrt(np.einsum("ij,ij->i", emb, emb, dtype=np.float64))
                emb = (emb / np.maximum(norms, NORM_EPS)[:, None]).astype(np.float32)
        return split_outputs({self.output_name: emb}, n, rename={self.output_name: OUTPUT_NAME})

    def warmup_requests(self) -> list:
        """One raw PNG: decoder, resize, fused pass in assembly, model and postprocess.

        A single request on purpose: the runtime sends warm-ups one at a time, each waiting up
        to ``max_queue_delay_us`` alone in its queue, and the tensor routes only add a memcpy
        (fp32) or the same fused pass (uint8) to what this one exercises."""
        buf = io.BytesIO()
        Image.new("RGB", (WARMUP_IMAGE_SIDE, WARMUP_IMAGE_SIDE), (128, 128, 128)).save(buf, "PNG")
        return [new_infer_request(self.name).for_raw_input(buf.getvalue(), "image/png").build()]

    def describe(self) -> dict:
        return {**super().describe(), "output": OUTPUT_NAME, "model_output": self.output_name,
                "outputs": {OUTPUT_NAME: ["fp32", list(getattr(self, "_out_dims", [None]))]},
                "normalize": self.normalize, "max_image_pixels": self.max_pixels}
