"""``vad`` backend: Silero VAD v5, one 512-sample chunk (32 ms at 16 kHz) per request.

Every fact about the model itself (sizes, I/O names, dtypes) lives in
:mod:`lumen_core.models.silero`.  The task is stateful: a stream is a sequence
(``lumen.sequence.id``, ``start`` on the first chunk, ``end`` on the last) served by the
sequence batcher.  The runtime keeps both pieces of per-stream memory the model needs, so a
client sends only its new samples:

- the recurrent state ``[2, N, 128]`` (batch axis 1), declared as implicit state
  ``state -> stateN`` in ``[[tasks.sequence.state]]``, with the scalar ``sr`` as a
  ``[[tasks.sequence.constant]]`` (the backend declares both, :func:`default_sequence`, for a
  config that declares neither);
- the 64-sample context: the model's input is ``[N, 576]`` = the last 64 samples of the
  stream's previous chunk (zeros at the start) followed by the new 512
  (:class:`~lumen_core.engine.state.ContextInput`).

Inputs (all converge on one execution signature, so raw and tensor requests batch together):

- ``audio/L16;rate=16000``: PCM16 little-endian mono, exactly 512 samples (1024 bytes);
- ``audio/pcm;format=f32le;rate=16000``: 512 float32 little-endian samples (2048 bytes);
- tensor route: fp32 ``[1, 512]``, layout ``NL``, preprocess id ``silero_vad_16k_v5``.

Output: ``speech_prob`` fp32 ``[1]``, the probability that the chunk holds speech.

Speech segments (:mod:`.vad_segments`, silero-vad's own post-process) are computed by whoever
runs the stream (the HTTP whole-file route, the WebSocket stream) from these probabilities;
the task's ``[tasks.options]`` hold their defaults (``threshold``, ``min_speech_duration_ms``,
``min_silence_duration_ms``, ``speech_pad_ms``, ``max_speech_duration_s``), published in
``describe()["segments"]``, and a request overrides them with ``lumen.vad.*`` keys, checked
here on every request that carries one.
"""
from __future__ import annotations

import os

import numpy as np

from .. import native
from ..batching.signature import signature
from ..config import BACKEND_BATCHING_DEFAULTS, ConstantConfig, SequenceConfig, StateConfig
from ..contract import (
    DTYPES,
    KEY_SEQUENCE_END,
    KEY_SEQUENCE_ID,
    KEY_SEQUENCE_START,
    TensorContract,
    TensorSpec,
)
from ..engine.plan import ModelSpec, OutputSpec, PreparedModelRequest
from ..engine.session import read_io
from ..engine.state import ContextInput, check_model_io, sequence_plans
from ..errors import ConfigError, InvalidArgument, UnsupportedMediaType
from ..models import MODEL_FILE, SILERO_VAD, require_model
from ..models.silero import (
    CHUNK_SAMPLES,
    CONTEXT_SAMPLES,
    INPUT,
    INPUT_DTYPE,
    MODEL_ID,
    OUTPUT,
    OUTPUT_DTYPE,
    SAMPLE_RATE,
    SAMPLE_RATE_DTYPE,
    SAMPLE_RATE_INPUT,
    STATE,
    STATE_BATCH_AXIS,
    STATE_DIMS,
    STATE_DTYPE,
    STATE_OUTPUT,
)
from ..request import InferRequest
from . import vad_segments
from .base import TaskBackend, split_outputs

PREPROCESS_ID = "silero_vad_16k_v5"
MIME_L16 = "audio/l16"
MIME_PCM = "audio/pcm"
PCM_FORMAT = "f32le"
#: the full media types the raw route takes (``;channels=1`` may be added to either)
MIME_L16_ACCEPTED = f"audio/L16;rate={SAMPLE_RATE}"
MIME_PCM_ACCEPTED = f"audio/pcm;rate={SAMPLE_RATE};format={PCM_FORMAT}"
LAYOUT = "NL"
OUTPUT_NAME = "speech_prob"
#: PCM16 full scale (Silero and torchaudio normalise int16 samples by 1/32768)
PCM16_SCALE = np.float32(1.0 / 32768.0)
WARMUP_SEQUENCE_ID = "lumen-warmup"
#: the batching defaults of every vad task, a config file's or the default one (config/batching.py)
DEFAULT_MAX_BATCH_SIZE = BACKEND_BATCHING_DEFAULTS["vad"]["max_batch_size"]
DEFAULT_MAX_QUEUE_SIZE = BACKEND_BATCHING_DEFAULTS["vad"]["max_queue_size"]
DEFAULT_IDLE_US = 10_000_000
#: a free lane forms its next batch at once from whatever is ready: the lane's worker forms it
#: itself the moment a run ends, so the streams answered from one batch send their next chunk
#: while the model computes the other group, and two groups alternate without waiting
#: (a zero delay beat a 2 ms one once formation moved into the worker: ``bench/bench_vad.py
#: --delay-us``, runs in bench/HISTORY.md, "vad (in process)")
DEFAULT_QUEUE_DELAY_US = 0
DEFAULT_SLOT_UTILIZATION = 0.5
ITEM_SHAPE = (CHUNK_SAMPLES,)
#: distinct validated mime strings remembered for the fast path (clients reuse one or two)
MAX_CACHED_MIMES = 64


def default_sequence() -> SequenceConfig:
    """Silero's stateful inputs: the ``state`` tensor and the scalar sample rate ``sr``."""
    return SequenceConfig(
        state=(StateConfig(STATE, STATE_OUTPUT, STATE_DTYPE, STATE_DIMS, STATE_BATCH_AXIS),),
        constant=(ConstantConfig(SAMPLE_RATE_INPUT, SAMPLE_RATE_DTYPE, (),
                                 np.array(SAMPLE_RATE, DTYPES[SAMPLE_RATE_DTYPE])),),
    )


class VadBackend(TaskBackend):
    raw_mimes = (MIME_L16, MIME_PCM)
    raw_mimes_written = (MIME_L16_ACCEPTED, MIME_PCM_ACCEPTED)
    stateful = True
    options_schema = vad_segments.OPTION_SCHEMA
    request_options = vad_segments.REQUEST_OPTIONS

    def __init__(self, config):
        super().__init__(config)
        self._mime_cache: dict = {}  # payload_mime string -> validated prepare function
        m = self.options.get("max_speech_duration_s")
        if m is not None and m <= 0:
            raise ConfigError(config.source, f"{config.key}.options.max_speech_duration_s",
                              f"must be > 0 (leave it out for no limit), got {m!r}")
        #: the task's segment defaults (``lumen.vad.*`` override them per request)
        self.segment_options = vad_segments.options_from_config(self.options)

    def describe(self) -> dict:
        """``raw_mimes`` are the media types accepted as written; ``accepts`` is exactly what
        each one needs (parameters, bytes per request), ``default_mime`` what a raw payload
        without a mime is read as (OIP BYTES without ``content_type``)."""
        return {**super().describe(), "segments": self.segment_options.to_dict(),
                "sample_rate": SAMPLE_RATE, "chunk_samples": CHUNK_SAMPLES,
                "accepts": [
                    {"mime": MIME_L16_ACCEPTED, "optional": {"channels": "1"},
                     "sample": "int16 little-endian", "chunk_samples": CHUNK_SAMPLES,
                     "chunk_bytes": CHUNK_SAMPLES * 2},
                    {"mime": MIME_PCM_ACCEPTED, "optional": {"channels": "1"},
                     "sample": "float32 little-endian, finite", "chunk_samples": CHUNK_SAMPLES,
                     "chunk_bytes": CHUNK_SAMPLES * 4}],
                "default_mime": MIME_L16_ACCEPTED,
                "outputs": {OUTPUT_NAME: [OUTPUT_DTYPE, [1]]}}

    def declared_sequence(self) -> SequenceConfig:
        return default_sequence()

    def load(self) -> ModelSpec:
        cfg = self.config
        path = cfg.model
        if not path:
            path = str(require_model(SILERO_VAD) / MODEL_FILE)
        elif not os.path.isfile(path):
            raise ConfigError(cfg.source, f"{cfg.key}.model", f"no such file: {path}")
        inputs, outputs = read_io(path)
        in_names = [i[0] for i in inputs]
        out_names = [o[0] for o in outputs]
        assert self.sequence is not None  # a stateful backend: effective_sequence set it
        plans = sequence_plans(self.sequence, cfg.source, cfg.key)
        check_model_io(plans, in_names, out_names, cfg.source, cfg.key)
        missing = [n for n in (INPUT, OUTPUT) if n not in in_names + out_names]
        if missing:
            raise ConfigError(cfg.source, f"{cfg.key}.model", f"{path} is not a Silero VAD v5 "
                                                              f"model (no {missing})")
        self.model_id = cfg.model_id or MODEL_ID
        self.signature = signature(self.name, self.model_id, cfg.model_version, INPUT_DTYPE,
                                   ITEM_SHAPE, LAYOUT, PREPROCESS_ID)
        self.contract = TensorContract(
            specs=(TensorSpec(INPUT_DTYPE, LAYOUT, frozenset({PREPROCESS_ID}),
                              ((1, 1), (CHUNK_SAMPLES, CHUNK_SAMPLES))),),
            model_id=self.model_id, model_version=cfg.model_version,
            raw_preprocess_ids=frozenset({PREPROCESS_ID}))
        window = ContextInput(INPUT, DTYPES[INPUT_DTYPE], CHUNK_SAMPLES, CONTEXT_SAMPLES)
        outs = [OutputSpec(OUTPUT, DTYPES[OUTPUT_DTYPE], (1,))]
        outs += [p.output_spec() for p in plans if hasattr(p, "output_spec")]
        self.model = ModelSpec(path, [window] + plans, outs)
        return self.model

    # -- request path ---------------------------------------------------------------------
    def prepare(self, req: InferRequest, desc, payload: memoryview) -> PreparedModelRequest:
        """Streams repeat one mime string per chunk: after the first chunk, a validated mime
        skips the parse (32 ms chunks make per-request costs count)."""
        meta = req.meta
        if meta and vad_segments.has_vad_keys(meta):
            vad_segments.segment_options(meta, self.segment_options)  # checked, 400 if bad
        if desc.kind == "raw" and isinstance(req.payload_mime, str):
            fast = self._mime_cache.get(req.payload_mime)
            if fast is not None:
                return fast(payload)
        return super().prepare(req, desc, payload)

    def prepare_raw(self, req: InferRequest, desc, payload: memoryview, mime: str,
                    params: dict) -> PreparedModelRequest:
        rate = params.get("rate")
        if rate != str(SAMPLE_RATE):
            raise UnsupportedMediaType(
                f"task {self.name!r} takes 16 kHz audio: the mime type needs rate={SAMPLE_RATE}, "
                f"got {req.payload_mime!r}", "payload_mime")
        channels = params.get("channels", "1")
        if channels != "1":
            raise UnsupportedMediaType(f"task {self.name!r} takes mono audio (channels=1), got "
                                       f"{req.payload_mime!r}", "payload_mime")
        if mime == MIME_L16:
            fast = self._prepare_l16
        else:
            fmt = params.get("format")
            if fmt != PCM_FORMAT:
                raise UnsupportedMediaType(
                    f"task {self.name!r} takes audio/pcm only as format={PCM_FORMAT} (float32 "
                    f"little-endian), got {req.payload_mime!r}; send PCM16 as audio/L16",
                    "payload_mime")
            fast = self._prepare_f32
        if len(self._mime_cache) < MAX_CACHED_MIMES:
            self._mime_cache[req.payload_mime] = fast
        return fast(payload)

    def _prepare_l16(self, payload: memoryview) -> PreparedModelRequest:
        if payload.nbytes != CHUNK_SAMPLES * 2:
            raise self._size_error(payload, 2, "PCM16")
        samples = np.frombuffer(payload, dtype="<i2") * PCM16_SCALE
        return PreparedModelRequest(self.signature, (samples,), ITEM_SHAPE)

    def _prepare_f32(self, payload: memoryview) -> PreparedModelRequest:
        if payload.nbytes != CHUNK_SAMPLES * 4:
            raise self._size_error(payload, 4, "float32")
        return PreparedModelRequest(self.signature, (self._finite(payload),), ITEM_SHAPE)

    @staticmethod
    def _finite(payload: memoryview) -> memoryview:
        """Refuse NaN / inf samples: Silero answers them with a finite probability and keeps a
        corrupted state, so every later chunk of the stream would silently be wrong (one compiled
        scan of the chunk: its cost is inside ``bench/bench_vad.py``'s figures)."""
        pos = native.assemble.first_non_finite(payload)  # the GIL stays with the loop
        if pos >= 0:
            raise InvalidArgument(f"sample {pos} is not finite (NaN or inf); audio samples must "
                                  f"be finite", "payload")
        return payload

    def _size_error(self, payload: memoryview, width: int, what: str) -> InvalidArgument:
        return InvalidArgument(
            f"task {self.name!r} takes exactly {CHUNK_SAMPLES} {what} samples "
            f"({CHUNK_SAMPLES * width} bytes, 32 ms at 16 kHz) per request, got "
            f"{payload.nbytes} bytes", "payload")

    def prepare_tensor(self, req: InferRequest, desc, payload: memoryview) -> PreparedModelRequest:
        return PreparedModelRequest(self.signature, (self._finite(payload),), ITEM_SHAPE)

    def postprocess(self, outputs: dict, items) -> list:
        return split_outputs({OUTPUT_NAME: outputs[OUTPUT]}, len(items))

    def warmup_requests(self) -> list:
        """One silent chunk as a whole (start + end) sequence through the raw route."""
        return [InferRequest(task=self.name, payload=bytes(CHUNK_SAMPLES * 2),
                             payload_mime=f"audio/L16;rate={SAMPLE_RATE}",
                             meta={KEY_SEQUENCE_ID: WARMUP_SEQUENCE_ID, KEY_SEQUENCE_START: "true",
                                   KEY_SEQUENCE_END: "true"})]


#: engine instances of the built-in vad task (see default_task_table)
DEFAULT_INSTANCES = 2


def default_task_table() -> dict:
    """The built-in ``vad`` task; ModelMissingError when Silero VAD is not prepared.

    Its ``[tasks.sequence]`` holds policy only: the backend declares Silero's stateful inputs
    (:func:`default_sequence`)."""
    require_model(SILERO_VAD)
    return {
        "name": "vad",
        "backend": "vad",
        # Silero VAD does not scale past one intra-op thread, so two single-thread instances,
        # each with its own lane of slots, use the cores better than one wide one
        # (``bench/bench_vad.py --instances``; runs in bench/HISTORY.md, "vad (in process)").
        "instances": DEFAULT_INSTANCES,
        "intra_op_threads": 1,
        "batching": {"max_batch_size": DEFAULT_MAX_BATCH_SIZE,
                     "max_queue_size": DEFAULT_MAX_QUEUE_SIZE},
        "sequence": {
            "strategy": "direct",
            "max_sequence_idle_us": DEFAULT_IDLE_US,
            "max_queue_delay_us": DEFAULT_QUEUE_DELAY_US,
            "minimum_slot_utilization": DEFAULT_SLOT_UTILIZATION,
        },
    }
