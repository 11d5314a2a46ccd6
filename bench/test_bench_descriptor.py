"""Micro benchmarks for descriptor parse + validate: compiled (``lumen_core.request_path._descriptor``) vs
the pure-Python definition (``lumen_core.request_path.descriptor``), both chosen through ``lumen_core.native``.

    pytest bench/test_bench_descriptor.py --benchmark-only   # pytest-benchmark tables, by group
    python bench/test_bench_descriptor.py                    # one run, prints times and ratios

Groups:

- ``descriptor-tensor``: the SPEC's tensor-route example -- 8 ``lumen.*`` keys (kind, dtype,
  shape ``[1,3,224,224]``, layout, preprocess id, model id, model version, priority) validated
  against a CLIP-like contract.  Target (SPEC section 7): compiled >= 10x faster than pure and
  under 2 us per call.
- ``descriptor-raw``: a raw request whose meta has no ``lumen.*`` key (one foreign key), the
  common case for text; the compiled call should cost about 100 ns.
- ``descriptor-reject``: the tensor meta with a payload one byte short -- the price of refusing
  a bad request (the error path builds a message; it is not tuned, only bounded).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":                       # script mode from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lumen_core import contract as C  # noqa: E402
from lumen_core import native  # noqa: E402
from lumen_core.errors import InvalidArgument  # noqa: E402

CLIP_PP = "clip_image_openai_v1"
CONTRACT = C.TensorContract(
    specs=(C.TensorSpec("fp32", "NCHW", {CLIP_PP}, ((1, 1), (3, 3), (224, 224), (224, 224))),
           C.TensorSpec("uint8", "NHWC", {"uint8_hwc_rgb_v1"},
                        ((1, 1), (224, 224), (224, 224), (3, 3)))),
    model_id="clip_vision_encoder", model_version="v1", raw_preprocess_ids={CLIP_PP})
TENSOR_META = {
    C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "fp32", C.KEY_SHAPE: "[1,3,224,224]",
    C.KEY_LAYOUT: "NCHW", C.KEY_PREPROCESS_ID: CLIP_PP, C.KEY_MODEL_ID: "clip_vision_encoder",
    C.KEY_MODEL_VERSION: "v1", C.KEY_PRIORITY: "1",
}
TENSOR_NBYTES = 4 * 3 * 224 * 224
RAW_META = {"x-request-source": "bench"}
RAW_NBYTES = 42
#: script mode: interleaved rounds per case (median reported; the machine is shared)
SCRIPT_ROUNDS = 25
#: script mode: calls per round
SCRIPT_INNER = 2000
#: SPEC section 7 targets for the compiled tensor case
TARGET_RATIO = 10.0
TARGET_US = 2.0


def _impls() -> dict:
    mods = {"pure": native.pure("descriptor")}
    if not native.NO_EXTENSIONS:
        mods["compiled"] = native.compiled("descriptor")
    return mods


def _reject(parse) -> str:
    try:
        parse(TENSOR_META, TENSOR_NBYTES - 1, CONTRACT)
    except InvalidArgument as exc:
        return exc.field
    raise AssertionError("a short payload was accepted")


# ------------------------------------------------------------------------- pytest-benchmark
try:
    import pytest
except ImportError:  # pragma: no cover - script mode without pytest
    pytest = None

if pytest is not None:
    IMPL_NAMES = list(_impls())

    @pytest.mark.parametrize("name", IMPL_NAMES)
    def test_descriptor_tensor(benchmark, name):
        benchmark.group = "descriptor-tensor"
        d = benchmark(_impls()[name].parse_meta, TENSOR_META, TENSOR_NBYTES, CONTRACT)
        assert (d.kind, d.shape, d.nbytes) == ("tensor", (1, 3, 224, 224), TENSOR_NBYTES)

    @pytest.mark.parametrize("name", IMPL_NAMES)
    def test_descriptor_raw(benchmark, name):
        benchmark.group = "descriptor-raw"
        d = benchmark(_impls()[name].parse_meta, RAW_META, RAW_NBYTES, CONTRACT)
        assert d.kind == "raw" and d.shape is None

    @pytest.mark.parametrize("name", IMPL_NAMES)
    def test_descriptor_reject(benchmark, name):
        benchmark.group = "descriptor-reject"
        assert benchmark(_reject, _impls()[name].parse_meta) == C.FIELD_PAYLOAD


# ------------------------------------------------------------------------------ script mode
def _times(cases: dict, rounds: int, inner: int) -> dict:
    """Median seconds per call for each case, interleaving cases so drift hits all alike."""
    samples = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[k].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    mods = _impls()
    cases = {}
    for name, mod in mods.items():
        parse = mod.parse_meta
        cases[("tensor", name)] = lambda p=parse: p(TENSOR_META, TENSOR_NBYTES, CONTRACT)
        cases[("raw", name)] = lambda p=parse: p(RAW_META, RAW_NBYTES, CONTRACT)
        cases[("reject", name)] = lambda p=parse: _reject(p)
    cases[("call overhead", "-")] = lambda: None
    t = _times(cases, SCRIPT_ROUNDS, SCRIPT_INNER)
    print(f"descriptor parse + validate, median of {SCRIPT_ROUNDS} interleaved rounds of "
          f"{SCRIPT_INNER} calls (per call, incl. the ~{t[('call overhead', '-')] * 1e9:.0f} ns "
          f"Python loop + lambda):")
    for group in ("tensor", "raw", "reject"):
        line = f"  {group:7s}" + "".join(f"  {n} {t[(group, n)] * 1e6:7.3f} us" for n in mods)
        if "compiled" in mods:
            line += f"   pure/compiled {t[(group, 'pure')] / t[(group, 'compiled')]:5.1f}x"
        print(line)
    if "compiled" in mods:
        ratio = t[("tensor", "pure")] / t[("tensor", "compiled")]
        us = t[("tensor", "compiled")] * 1e6
        verdict = "meets" if ratio >= TARGET_RATIO and us < TARGET_US else "MISSES"
        print(f"compiled tensor parse: {ratio:.1f}x the pure path, {us:.2f} us per call: "
              f"{verdict} the >= {TARGET_RATIO:.0f}x and < {TARGET_US:.0f} us target")


if __name__ == "__main__":
    main()
