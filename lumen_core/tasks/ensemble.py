"""What the image ensembles (``ocr``, ``face_detection``) share: their model directory, the
per-step engine options and step specs, and the decoded-RGB tensor route.

Each of those tasks is a pipeline of models (``batching/pipeline.py``) fed from one decoded
image, so the pieces around the pipeline are the same: a directory of prepared model files
(the config's ``model`` or the prepared default), ``<step>_instances`` / ``<step>_threads``
options per step, one :class:`~lumen_core.batching.pipeline.StepSpec` per step with the task's
queue delay and priorities, and a tensor route that takes a decoded uint8 RGB image
``[1, H, W, 3]`` (preprocess id ``rgb_uint8_v1``) under the task's pixel limit.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..batching.pipeline import StepSpec
from ..config import BatchingConfig, Option, TaskConfig
from ..contract import TensorContract, TensorSpec
from ..engine.plan import InputPlan
from ..errors import ConfigError, InvalidArgument, ModelMissingError
from ..models import PREPARE_COMMAND, require_model

#: the tensor route's preprocess id: a decoded RGB image, uint8 ``[1, H, W, 3]``
RGB_UINT8_ID = "rgb_uint8_v1"
CHANNELS = 3
#: largest side of a tensor-route image
MAX_TENSOR_SIDE = 16384
TENSOR_FIELD = "lumen.tensor.shape"


class ItemInput(InputPlan):
    """A step input built item by item: ``fill(item, dest_row)`` writes one item (a crop, a
    pyramid level, a detector image) into its row of the fp32 batch ``[N, *item_shape]``, so
    resizing and normalising happen in the step's worker thread, straight into the batch."""

    def __init__(self, name: str, fill: Callable[[Any, np.ndarray], None]):
        self.name, self.fill = name, fill

    def assemble(self, items, arena, stats) -> dict:
        dest = arena.get(self.name, (len(items),) + tuple(items[0].item_shape), np.float32)
        fill = self.fill
        for i, it in enumerate(items):
            fill(it, dest[i])
        return {self.name: dest}


def step_options(labels: Mapping[str, str]) -> tuple:
    """``<step>_instances`` (1) and ``<step>_threads`` (0: the task's ``intra_op_threads``)
    for each step, ``labels`` naming the step's model in the options' descriptions."""
    instances = tuple(Option(f"{s}_instances", int, 1, f"{label} engine instances", lo=1, hi=64)
                      for s, label in labels.items())
    threads = tuple(Option(f"{s}_threads", int, 0, f"intra-op threads per {label} instance "
                           f"(0: the task's)", lo=0, hi=1024) for s, label in labels.items())
    return instances + threads


def step_specs(config: TaskConfig, options: Mapping[str, Any], models: Mapping[str, Any],
               posts: Mapping[str, Callable], sizes: Mapping[str, int],
               fanout: int) -> list:
    """One StepSpec per step (in ``models``' order): its batch cap from ``sizes``, the task's
    queue delay and priority levels, a queue bound of ``fanout`` items per request the task
    admits, and the step's engine options."""
    b = config.batching
    return [StepSpec(s, model, posts[s],
                     BatchingConfig(max_batch_size=sizes[s],
                                    max_queue_delay_us=b.max_queue_delay_us,
                                    max_queue_size=b.max_queue_size * fanout,
                                    priority_levels=b.priority_levels),
                     options[f"{s}_instances"], options[f"{s}_threads"])
            for s, model in models.items()]


def model_paths(config: TaskConfig, files: Sequence[str], prepared: str, task: str) -> dict:
    """``{file: path}`` of the task's model files: in the config's ``model`` directory, else
    in the prepared model ``prepared`` (ModelMissingError naming the command when absent)."""
    if config.model:
        if not os.path.isdir(config.model):
            raise ConfigError(config.source, f"{config.key}.model", f"must be a directory "
                              f"holding {', '.join(files)} (a prepared {prepared}); no such "
                              f"directory: {config.model}")
        d = config.model
    else:
        d = str(require_model(prepared))
    paths = {f: os.path.join(d, f) for f in files}
    for f, p in paths.items():
        if not os.path.isfile(p):
            raise ModelMissingError(f"the {task} model directory {d} lacks {f}; run "
                                    f"`{PREPARE_COMMAND}`", command=PREPARE_COMMAND)
    return paths


def rgb_tensor_contract(model_id: str, model_version: str) -> TensorContract:
    """The tensor route of an image ensemble: uint8 ``[1, H, W, 3]`` NHWC, ``rgb_uint8_v1``."""
    any_side = (1, MAX_TENSOR_SIDE)
    return TensorContract(
        specs=(TensorSpec("uint8", "NHWC", frozenset({RGB_UINT8_ID}),
                          ((1, 1), any_side, any_side, (CHANNELS, CHANNELS))),),
        model_id=model_id, model_version=model_version,
        raw_preprocess_ids=frozenset({RGB_UINT8_ID}))


def rgb_from_tensor(shape: Sequence[int], payload: memoryview, max_pixels: int) -> np.ndarray:
    """The validated tensor's image ``[H, W, 3]`` (no copy), refused over ``max_pixels``."""
    _n, h, w, _c = shape
    if h * w > max_pixels:
        raise InvalidArgument(f"image is {w}x{h} = {w * h} pixels; the limit is {max_pixels} "
                              f"(options.max_image_pixels)", TENSOR_FIELD)
    return np.frombuffer(payload, dtype=np.uint8).reshape(h, w, CHANNELS)
