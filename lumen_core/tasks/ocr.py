"""``ocr`` backend (task ``ocr``): detect -> classify -> recognise, an ensemble of three models.

The models are rapidocr 3.10.0's (``lumen models prepare`` copies them from the ``rapidocr``
package: :mod:`lumen_core.models.rapidocr`) and every step reproduces rapidocr's defaults
(:mod:`.ocr_post`), so the answers equal ``RapidOCR()``'s on the same files.  The backend
declares three steps (:class:`~lumen_core.batching.pipeline.StepSpec`), each its own batched
model, and one flow per request:

1. **prepare** (the preprocessing pool): decode (raw ``image/jpeg|png|webp`` with the bomb
   guards of :mod:`.imaging`, or the uint8 ``[1,H,W,3]`` RGB tensor ``rgb_uint8_v1``), RGB ->
   BGR, rapidocr's global resize and vertical padding, the detector's resize (shorter side 736,
   multiples of 32);
2. **det** step: normalised ``(x/255-0.5)/0.5`` straight into the batch buffer (the fused
   compiled pass), batched with other images of the same detector size; its postprocess (in
   the engine worker thread) runs the DB post-process and the perspective crops;
3. **cls** step: every crop at 3x48x192 (one signature, so crops of all requests batch
   together); postprocess rotates a crop by 180 degrees when labelled ``180`` with score >
   0.9;
4. **rec** step: crops at height 48 in **width buckets** (:func:`.ocr_post.rec_batch_width`:
   at least 320, at most 1.25x the crop's own width): the bucket is part of the execution
   signature, so a crop is read at the same width whichever requests it batches with, and the
   answer of an image equals its answer alone; greedy CTC in the postprocess;
5. the flow keeps lines with non-blank text and score >= ``text_score`` (0.5) and maps boxes
   back to input pixels.

Bounds on one request's work (each a ``[tasks.options]`` key): ``max_image_pixels`` (decoded
pixels), ``max_det_pixels`` (the detector input that rapidocr's resize and padding make of the
image, computed from its size before any pixel is touched: a 400x2 strip would be a 6016x1504
input), and ``max_rec_pixels``, the recognition budget: the sum over the detected lines of the
area each is read at (48 x its width bucket), checked once the detector has found them and
before any is classified or read, so a page of small dense text cannot hold a core for a
minute.

Output: ``lines``, a list of ``{"text", "score", "box"}`` (box: 4 ``[x, y]`` points, clockwise
from top-left, input-image pixels) in reading order; an image with no text gives ``[]``.
"""
from __future__ import annotations

import io
import os
from typing import Any, Optional, Sequence

import numpy as np
from PIL import Image

from .. import native
from ..batching.signature import signature
from ..config import Option, TaskConfig
from ..engine.plan import ModelSpec, OutputSpec, PreparedModelRequest
from ..engine.session import read_io
from ..errors import (
    ConfigError,
    InternalError,
    InvalidArgument,
    PayloadTooLarge,
)
from ..models import OCR, require_model
from ..models import rapidocr as R
from ..request import InferRequest, new_infer_request
from ..request_path.descriptor import Descriptor
from . import ensemble as E
from . import ocr_post as P
from .base import TaskBackend
from .imaging import MIME_FORMATS, decode_image

#: the tensor route's preprocess id: a decoded RGB image, uint8 ``[1, H, W, 3]``
RGB_UINT8_ID = E.RGB_UINT8_ID
OUTPUT_NAME = "lines"
#: default decompression-bomb limit (decoded pixels), as image_embed's
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
#: default bound of the detector input (pixels): just above the largest that rapidocr's
#: geometry makes of any image with sides of 30..2000 pixels (2000x250 -> 5888x736 = 4.33 MP)
DEFAULT_MAX_DET_PIXELS = 4_500_000
#: default recognition budget of one request (sum of 48 x width over its lines; what it costs:
#: docs/ocr.md)
DEFAULT_MAX_REC_PIXELS = 8_000_000
#: per-step batching (the task's ``max_queue_delay_us`` / priorities apply to all steps):
#: detector inputs are big (0.5-3 MB each), crops are small and many
DET_MAX_BATCH, CLS_MAX_BATCH, REC_MAX_BATCH = 4, 64, 32
#: items a step may hold queued, per request the task admits (one request fans out to
#: up to ``DET_MAX_CANDIDATES`` crops)
STEP_QUEUE_FANOUT = 64
#: internal preprocess ids of the step inputs (they name the recipe inside the signature)
DET_ID, CLS_ID, REC_ID = "rapidocr_det_v1", "rapidocr_cls_v1", "rapidocr_rec_v1"
#: a square warm-up image: the detector raises the shorter side to 736, so square is cheapest
WARMUP_SIDE = 64
STEPS = ("det", "cls", "rec")
#: the default task's largest det / rec instance count (``default_instances``)
MAX_DEFAULT_INSTANCES = 4
CHANNELS = 3


class DetItem(PreparedModelRequest):
    """One image ready for the detector, with what the flow needs to finish it."""

    __slots__ = ("img", "top", "ratio_h", "ratio_w", "ori_h", "ori_w")

    def __init__(self, sig: Any, det: Optional[np.ndarray], img: Optional[np.ndarray], top: int,
                 ratio_h: float, ratio_w: float, ori_h: int, ori_w: int):
        shape = (CHANNELS,) + det.shape[:2] if det is not None else ()
        super().__init__(sig, (det,), shape)
        self.img, self.top, self.ratio_h, self.ratio_w = img, top, ratio_h, ratio_w
        self.ori_h, self.ori_w = ori_h, ori_w


def _fill_det(item: Any, dest: np.ndarray) -> None:
    """uint8 BGR ``[H, W, 3]`` -> its detector row fp32 ``[3, H, W]``, ``(x/255-0.5)/0.5`` by
    the fused compiled pass."""
    native.image.normalize_hwc_to_chw(item.tensors[0], dest, P.DET_MEAN, P.DET_STD)


def _fill_crop(item: Any, dest: np.ndarray) -> None:
    """A crop resized to the batch's height (aspect kept) and padded to its width with zeros;
    the width is the signature's (every item of a batch has the same ``item_shape``)."""
    P.normalise_crop(item.tensors[0], dest)


class OcrBackend(TaskBackend):
    raw_mimes = tuple(MIME_FORMATS)
    prepare_off_loop = True  # decode + resize: milliseconds of CPU per image
    options_schema = (
        Option("text_score", float, P.TEXT_SCORE, "the lowest recognition score a line keeps",
               lo=0.0, hi=1.0),
        Option("max_image_pixels", int, DEFAULT_MAX_IMAGE_PIXELS,
               "decompression-bomb limit on decoded pixels", lo=1),
        Option("max_det_pixels", int, DEFAULT_MAX_DET_PIXELS,
               "the largest detector input (pixels, after rapidocr's resize and padding)",
               lo=1),
        Option("max_rec_pixels", int, DEFAULT_MAX_REC_PIXELS,
               "recognition budget of one request (sum of 48 x width over its lines)", lo=1),
        *E.step_options({"det": "detector", "cls": "classifier", "rec": "recogniser"}),
    )

    def __init__(self, config: TaskConfig):
        super().__init__(config)
        P.require_libs()
        self.text_score: float = self.options["text_score"]
        self.max_pixels: int = self.options["max_image_pixels"]
        self.max_det_pixels: int = self.options["max_det_pixels"]
        self.max_rec_pixels: int = self.options["max_rec_pixels"]
        self.model_id = config.model_id or R.MODEL_ID
        self.characters: list = []

    # -- load ---------------------------------------------------------------------------------
    def load(self) -> ModelSpec:
        """Read the three models' I/O, the alphabet, build the contract; the steps' specs."""
        cfg = self.config
        paths = E.model_paths(cfg, tuple(R.SOURCES), OCR, self.name)
        names = {}
        for f, p in paths.items():
            inputs, outputs = read_io(p)
            if len(inputs) != 1 or inputs[0][1] != "fp32" or len(inputs[0][2]) != 4:
                raise ConfigError(cfg.source, f"{cfg.key}.model", f"{p}: expected one fp32 "
                                  f"[N,3,H,W] input, got {inputs}")
            names[f] = (inputs[0][0], outputs[0][0])
        self.characters = P.characters_from_metadata(_metadata(paths[R.REC_FILE]))
        base = (self.model_id, cfg.model_version, "fp32")
        self._sig = lambda step, shape, pid: signature(f"{self.name}.{step}", *base, shape,
                                                       "NCHW", pid)
        self._cls_sig = self._sig("cls", P.CLS_SHAPE, CLS_ID)
        self._models = {
            "det": ModelSpec(paths[R.DET_FILE], [E.ItemInput(names[R.DET_FILE][0], _fill_det)],
                             [OutputSpec(names[R.DET_FILE][1], np.float32)]),
            "cls": ModelSpec(paths[R.CLS_FILE], [E.ItemInput(names[R.CLS_FILE][0], _fill_crop)],
                             [OutputSpec(names[R.CLS_FILE][1], np.float32,
                                         (len(P.CLS_LABELS),))]),
            "rec": ModelSpec(paths[R.REC_FILE], [E.ItemInput(names[R.REC_FILE][0], _fill_crop)],
                             [OutputSpec(names[R.REC_FILE][1], np.float32)]),
        }
        self._outs = {s: m.outputs[0].name for s, m in self._models.items()}
        self.contract = E.rgb_tensor_contract(self.model_id, cfg.model_version)
        self.model = self._models["det"]
        return self.model

    def steps(self) -> list:
        """The ensemble: det -> cls -> rec, each with its own batching and engine pool."""
        cap = self.config.batching.max_batch_size
        sizes = {"det": min(cap, DET_MAX_BATCH), "cls": min(cap, CLS_MAX_BATCH),
                 "rec": min(cap, REC_MAX_BATCH)}
        post = {"det": self._det_post, "cls": self._cls_post, "rec": self._rec_post}
        # a step holds every line of one request per request the task admits: at most the
        # detector's candidates, and no more than the recognition budget reads at 48 x 320
        read_at = P.REC_SHAPE[1] * P.REC_SHAPE[2]
        lines = min(P.DET_MAX_CANDIDATES, self.max_rec_pixels // read_at)
        return E.step_specs(self.config, self.options, self._models, post, sizes,
                            max(STEP_QUEUE_FANOUT, lines))

    # -- prepare (the preprocessing pool) -------------------------------------------------------
    def prepare_raw(self, req: InferRequest, desc: Descriptor, payload: memoryview, mime: str,
                    params: dict) -> PreparedModelRequest:
        src = req.payload if isinstance(req.payload, bytes) else payload
        rgb = np.asarray(decode_image(src, mime, self.max_pixels))
        return self._prepare_rgb(rgb, "payload")

    def prepare_tensor(self, req: InferRequest, desc: Descriptor,
                       payload: memoryview) -> PreparedModelRequest:
        rgb = E.rgb_from_tensor(desc.shape, payload, self.max_pixels)
        return self._prepare_rgb(rgb, E.TENSOR_FIELD)

    def _prepare_rgb(self, rgb: np.ndarray, field: str) -> DetItem:
        """rapidocr's LoadImage (RGB -> BGR), global resize, vertical padding, det resize;
        a shape whose detector input would exceed ``max_det_pixels`` is refused first."""
        size = P.det_input_size(*rgb.shape[:2])
        if size is not None and size[0] * size[1] > self.max_det_pixels:
            h, w = rgb.shape[:2]
            raise InvalidArgument(f"image is {w}x{h}: rapidocr's resize and padding make it a "
                                  f"{size[1]}x{size[0]} = {size[0] * size[1]} pixel detector "
                                  f"input, above the limit of {self.max_det_pixels} "
                                  f"(options.max_det_pixels); the aspect ratio is too extreme",
                                  field)
        ori = np.ascontiguousarray(rgb[:, :, ::-1])
        ori_h, ori_w = ori.shape[:2]
        img, rh, rw = P.resize_within_bounds(ori)
        det: Optional[np.ndarray] = None
        top = 0
        if img is not None:
            img, top = P.vertical_padding(img)
            det = P.det_resize(img)
        if det is None:  # the image vanishes at the detector's stride: no text
            return DetItem(self._sig("det", (), DET_ID), None, None, 0, 1.0, 1.0, ori_h, ori_w)
        return DetItem(self._sig("det", (CHANNELS,) + det.shape[:2], DET_ID), det, img, top,
                       rh, rw, ori_h, ori_w)

    # -- step postprocesses (engine worker threads) -------------------------------------------
    def _det_post(self, outputs: dict, items: Sequence[DetItem]) -> list:
        prob = outputs[self._outs["det"]]
        out: list = []
        for i, it in enumerate(items):
            p = prob[i, 0]
            if not np.isfinite(p).all():
                out.append(InternalError("the detector produced a non-finite value"))
                continue
            img = it.img
            assert img is not None  # an image that vanished at the stride never reaches det
            boxes, _scores = P.db_boxes(p, img.shape[0], img.shape[1])
            out.append((boxes, [P.crop(img, b) for b in boxes]))
        return out

    def _cls_post(self, outputs: dict, items: Sequence[PreparedModelRequest]) -> list:
        probs = outputs[self._outs["cls"]]
        out: list = []
        for i, it in enumerate(items):
            k = int(probs[i].argmax())
            crop = it.tensors[0]
            if "180" in P.CLS_LABELS[k] and probs[i, k] > P.CLS_THRESH:
                crop = P.rotate_180(crop)
            out.append(crop)
        return out

    def _rec_post(self, outputs: dict, items: Sequence[PreparedModelRequest]) -> list:
        probs = outputs[self._outs["rec"]]
        return [P.ctc_decode(probs[i], self.characters) for i in range(len(items))]

    # -- the flow (event loop) -----------------------------------------------------------------
    async def flow(self, ctx: Any, item: DetItem) -> dict:
        if item.img is None:
            return {OUTPUT_NAME: []}
        (boxes, crops), = await ctx.run("det", [item])
        if not crops:
            return {OUTPUT_NAME: []}
        widths = [P.rec_batch_width(c.shape[0], c.shape[1]) for c in crops]
        budget = P.REC_SHAPE[1] * sum(widths)  # a 180-degree turn keeps a crop's shape
        if budget > self.max_rec_pixels:
            raise PayloadTooLarge(f"the image holds more text than one request reads: its "
                                  f"{len(crops)} lines are {budget} pixels to recognise, above "
                                  f"the limit of {self.max_rec_pixels} "
                                  f"(options.max_rec_pixels); send it in parts", "payload")
        cls_sig = self._cls_sig
        upright = await ctx.run("cls", [PreparedModelRequest(cls_sig, (c,), P.CLS_SHAPE)
                                        for c in crops])
        rec_items = []
        for c, width in zip(upright, widths, strict=True):
            shape = (CHANNELS, P.REC_SHAPE[1], width)
            rec_items.append(PreparedModelRequest(self._sig("rec", shape, REC_ID), (c,), shape))
        texts = await ctx.run("rec", rec_items)
        keep = [i for i, (t, s) in enumerate(texts) if t.strip() and s >= self.text_score]
        if not keep:
            return {OUTPUT_NAME: []}
        mapped = P.map_boxes(boxes[keep], item.top, item.ratio_h, item.ratio_w, item.ori_h,
                             item.ori_w)
        return {OUTPUT_NAME: [{"text": texts[i][0], "score": texts[i][1],
                               "box": mapped[j].tolist()} for j, i in enumerate(keep)]}

    def postprocess(self, outputs: dict, items: Sequence[PreparedModelRequest]) -> list:
        raise InternalError("the ocr task runs as a pipeline of steps; it has no single model")

    def warmup_requests(self) -> list:
        """One small PNG with a dark bar on white: every step runs once."""
        img = Image.new("RGB", (WARMUP_SIDE, WARMUP_SIDE), (255, 255, 255))
        img.paste((0, 0, 0), (8, 28, 56, 36))
        buf = io.BytesIO()
        img.save(buf, "PNG")
        return [new_infer_request(self.name).for_raw_input(buf.getvalue(), "image/png").build()]

    def describe(self) -> dict:
        return {**super().describe(), "output": OUTPUT_NAME, "steps": list(STEPS),
                "outputs": {OUTPUT_NAME: ["json", [None]]}, "text_score": self.text_score,
                "max_image_pixels": self.max_pixels, "max_det_pixels": self.max_det_pixels,
                "max_rec_pixels": self.max_rec_pixels, "default_mime": "image/png"}


def _metadata(path: str) -> dict:
    import onnx

    model = onnx.load(path, load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}


def default_instances(cores: Optional[int] = None) -> int:
    """Detector and recogniser instances of the default task: one per core, at most
    ``MAX_DEFAULT_INSTANCES``.  One 1-thread instance per core, not one session with a thread
    per core: a 2-thread detector session spends more CPU per image than a 1-thread one, and a
    single detector instance, most of the model time, caps the whole task at one core
    (``bench/bench_ocr.py --setups``; the runs of issue 39 in bench/HISTORY.md)."""
    return max(1, min(cores or os.cpu_count() or 1, MAX_DEFAULT_INSTANCES))


def default_task_table() -> dict:
    """The built-in ``ocr`` task; ModuleNotFoundError when the [ocr] extra is missing,
    ModelMissingError when its models are not prepared.  Threads: 0 (cores // instances)
    per det / rec instance, one for the classifier (a few milliseconds per batch)."""
    P.require_libs()
    require_model(OCR)
    n = default_instances()
    return {"name": "ocr", "backend": "ocr", "intra_op_threads": 0,
            "options": {"det_instances": n, "rec_instances": n, "cls_threads": 1}}
