"""Silero VAD: the ONNX file shipped in the ``silero-vad`` PyPI package, copied and checked.

The model (``silero_vad/data/silero_vad.onnx``) runs one 32 ms step per call:

- ``input`` fp32 ``[N, 576]``: 64 samples of context (the tail of the stream's previous
  512-sample chunk, zeros before the first) followed by the new 512-sample chunk;
- ``state`` fp32 ``[2, N, 128]``: the recurrent state, batch on axis 1, zeros at stream start;
- ``sr`` int64 scalar: 16000;

and returns ``output`` fp32 ``[N, 1]`` (speech probability) and ``stateN`` ``[2, N, 128]``.
Rows of a batch are independent, so N streams can share one call when each carries its own
state row and context.
"""
from __future__ import annotations

import pathlib
import shutil
from typing import Any, Optional

import numpy as np

from ..engine.session import cpu_session
from ..errors import ModelMissingError
from ._files import (
    MODEL_FILE,
    ProgressFn,
    distribution_version,
    packaged_path,
    pip_command,
    sha256_file,
)

DIST = "silero-vad"
DIST_VERSION = "6.2.3"
MODULE = "silero_vad"
SOURCE_FILE = "data/silero_vad.onnx"

MODEL_ID = "silero-vad"
MODEL_VERSION = "1"
# Bump when what this module writes changes, so `prepare` redoes old outputs.
REVISION = 1

# The model's I/O facts (the ``vad`` task imports them from here).
SAMPLE_RATE = 16000
CHUNK_SAMPLES = 512
CONTEXT_SAMPLES = 64
STATE_LAYERS = 2
STATE_SIZE = 128
#: per-stream state dims (the batch axis left out) and where the batch axis sits
STATE_DIMS = (STATE_LAYERS, STATE_SIZE)
STATE_BATCH_AXIS = 1
INPUT = "input"
STATE = "state"
SAMPLE_RATE_INPUT = "sr"
OUTPUT = "output"
STATE_OUTPUT = "stateN"
#: dtypes (contract names) of the window input, the state, the scalar sample rate, the output
INPUT_DTYPE = "fp32"
STATE_DTYPE = "fp32"
SAMPLE_RATE_DTYPE = "int64"
OUTPUT_DTYPE = "fp32"
EXPECTED_INPUTS = (INPUT, STATE, SAMPLE_RATE_INPUT)
EXPECTED_OUTPUTS = (OUTPUT, STATE_OUTPUT)


def source_path() -> pathlib.Path:
    """The packaged ONNX file; a clear error naming the pip command if absent."""
    return packaged_path(MODULE, "", (SOURCE_FILE,), DIST, DIST_VERSION,
                         f"the {MODEL_ID} model") / SOURCE_FILE


def source_info() -> dict[str, Any]:
    return {
        "package": DIST,
        "version": distribution_version(DIST),
        "files": {SOURCE_FILE: sha256_file(source_path())},
        "revision": REVISION,
    }


def _check_signature(sess: Any) -> None:
    inputs = tuple(i.name for i in sess.get_inputs())
    outputs = tuple(o.name for o in sess.get_outputs())
    if inputs != EXPECTED_INPUTS or outputs != EXPECTED_OUTPUTS:
        raise ModelMissingError(
            f"{DIST} ships a {SOURCE_FILE} with inputs {inputs} / outputs {outputs}, expected "
            f"{EXPECTED_INPUTS} / {EXPECTED_OUTPUTS}; install the supported version with "
            f"`{pip_command(DIST, DIST_VERSION)}`",
            command=pip_command(DIST, DIST_VERSION),
        )


def run_streams(sess: Any, audio: np.ndarray) -> np.ndarray:
    """Speech probabilities ``[N, T // 512]`` for N streams ``[N, T]`` run side by side.

    The reference loop every VAD path must equal: one call per step for all streams, each
    row with its own state and 64-sample context.
    """
    audio = np.ascontiguousarray(audio, dtype=np.float32)
    n, total = audio.shape
    steps = total // CHUNK_SAMPLES
    state = np.zeros((STATE_LAYERS, n, STATE_SIZE), dtype=np.float32)
    window = np.zeros((n, CONTEXT_SAMPLES + CHUNK_SAMPLES), dtype=np.float32)
    sr = np.array(SAMPLE_RATE, dtype=np.int64)
    probs = np.empty((n, steps), dtype=np.float32)
    for step in range(steps):
        window[:, CONTEXT_SAMPLES:] = audio[:, step * CHUNK_SAMPLES:(step + 1) * CHUNK_SAMPLES]
        out, state = sess.run(None, {INPUT: window, STATE: state, SAMPLE_RATE_INPUT: sr})
        probs[:, step] = out[:, 0]
        window[:, :CONTEXT_SAMPLES] = window[:, -CONTEXT_SAMPLES:]
    return probs


def build(out_dir: pathlib.Path, progress: Optional[ProgressFn] = None) -> dict[str, Any]:
    """Copy the ONNX file into ``out_dir`` and check that it loads with the expected I/O."""
    say = progress or (lambda _msg: None)
    src = source_path()
    say(f"{MODEL_ID}: copying {MODULE}/{SOURCE_FILE}")
    shutil.copyfile(src, out_dir / MODEL_FILE)
    say(f"{MODEL_ID}: checking the model loads in ONNX Runtime")
    sess = cpu_session(out_dir / MODEL_FILE, intra_op_threads=1)
    _check_signature(sess)
    # one silent step: the model must run at the batch size the scheduler will use (N > 1)
    probs = run_streams(sess, np.zeros((2, CHUNK_SAMPLES), dtype=np.float32))
    if probs.shape != (2, 1) or not np.all(np.isfinite(probs)):
        raise RuntimeError(f"{MODEL_ID}: a silent chunk gave {probs!r}")
    return {
        "model_id": MODEL_ID,
        "model_version": MODEL_VERSION,
        "revision": REVISION,
        "inputs": {
            INPUT: ["float32", ["N", CONTEXT_SAMPLES + CHUNK_SAMPLES]],
            STATE: ["float32", [STATE_LAYERS, "N", STATE_SIZE]],
            SAMPLE_RATE_INPUT: ["int64", []],
        },
        "outputs_spec": {OUTPUT: ["float32", ["N", 1]], STATE_OUTPUT: ["float32", [STATE_LAYERS, "N", STATE_SIZE]]},
        "sample_rate": SAMPLE_RATE,
        "chunk_samples": CHUNK_SAMPLES,
        "context_samples": CONTEXT_SAMPLES,
        "state_batch_axis": STATE_BATCH_AXIS,
        "output_files": [MODEL_FILE],
    }
