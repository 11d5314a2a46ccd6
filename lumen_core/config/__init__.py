"""TOML configuration (SPEC section 6) -> typed, validated config objects.

Split by what it configures: ``server.py`` (``[server]``), ``batching.py``
(``[tasks.batching]``), ``sequence.py`` (``[tasks.sequence]``), ``tasks.py`` (``[[tasks]]``,
versions, cache, backend options), ``load.py`` (the whole file).  ``schema.py`` is how a
setting is declared once (name, kind, default, bounds, help) so that the dataclass default,
the parser's check, its error message and docs/configuration.md's table all come from it;
``python -m lumen_core.config.docs`` rewrites that table.

A config error names the file, the key and what is wrong (``lumen.toml: tasks[0].batching.
max_batch_size: must be an integer >= 1, got -1``), because a server that refuses to start must
say exactly which line to fix.

Backend-specific keys are declared by the backends, read here: ``[tasks.options]`` against a
backend's :class:`Option` schema (:func:`read_options`), and the stateful inputs a backend
declares for its model filled into ``[tasks.sequence]`` (:func:`effective_sequence`).  Both
return new objects; a parsed :class:`TaskConfig` is never changed after parsing.

Every name the single ``config.py`` module had is importable from here unchanged.
"""
from __future__ import annotations

from ..errors import ConfigError
from .batching import (
    BACKEND_BATCHING_DEFAULTS,
    DEFAULT_LOOP_EXECUTION_US,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_QUEUE_DELAY_US,
    DEFAULT_MAX_QUEUE_SIZE,
    MAX_LATENCY_TARGET_MS,
    MAX_LOOP_EXECUTION_US,
    MAX_PRIORITY_LEVELS,
    BatchingConfig,
)
from .load import LumenConfig, load_config, model_root, parse_config, read_toml
from .schema import (
    OPTION_KINDS,
    Option,
    Reader,
    Setting,
    read_settings,
    setting,
    settings_of,
    settings_table,
)
from .sequence import (
    CONSTANT_DTYPES,
    CONTROL_DTYPES,
    CONTROL_KINDS,
    CORRID_DTYPES,
    DEFAULT_MAX_SEQUENCE_IDLE_US,
    DEFAULT_SEQUENCE_STRATEGY,
    MAX_SEQUENCE_IDLE_US,
    MAX_SEQUENCE_SLOTS,
    MAX_STATE_RANK,
    SEQUENCE_STRATEGIES,
    SEQUENCE_UNUSED_BATCHING_KEYS,
    STATE_DTYPES,
    ConstantConfig,
    ControlConfig,
    SequenceConfig,
    StateConfig,
    effective_sequence,
)
from .server import (
    AUTH_OPTIONAL_ENDPOINTS,
    DEFAULT_ADMIN_MAX_MODEL_BYTES,
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT_MS,
    DEFAULT_GRPC_PORT,
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_READ_TIMEOUT_MS,
    DEFAULT_SHM_MAX_REGIONS,
    MAX_SHM_REGIONS,
    ServerConfig,
)
from .tasks import (
    MAX_CACHE_BYTES,
    MAX_CACHE_TTL_S,
    MAX_INSTANCES,
    MAX_TRAFFIC_WEIGHT,
    CacheConfig,
    TaskConfig,
    VersionConfig,
    parse_task,
    read_options,
    task_versions,
    traffic_weight,
)

__all__ = [
    "AUTH_OPTIONAL_ENDPOINTS", "BACKEND_BATCHING_DEFAULTS", "CONSTANT_DTYPES", "CONTROL_DTYPES",
    "CONTROL_KINDS", "CORRID_DTYPES", "DEFAULT_ADMIN_MAX_MODEL_BYTES", "DEFAULT_BODY_MIN_RATE",
    "DEFAULT_BODY_TIMEOUT_MS", "DEFAULT_GRPC_PORT", "DEFAULT_HOST", "DEFAULT_HTTP_PORT",
    "DEFAULT_LOOP_EXECUTION_US", "DEFAULT_MAX_BATCH_SIZE", "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_HEADER_BYTES", "DEFAULT_MAX_PAYLOAD_BYTES", "DEFAULT_MAX_QUEUE_DELAY_US",
    "DEFAULT_MAX_QUEUE_SIZE", "DEFAULT_MAX_SEQUENCE_IDLE_US", "DEFAULT_READ_TIMEOUT_MS",
    "DEFAULT_SEQUENCE_STRATEGY", "DEFAULT_SHM_MAX_REGIONS", "MAX_CACHE_BYTES", "MAX_CACHE_TTL_S",
    "MAX_INSTANCES", "MAX_LATENCY_TARGET_MS", "MAX_LOOP_EXECUTION_US", "MAX_PRIORITY_LEVELS",
    "MAX_SEQUENCE_IDLE_US", "MAX_SEQUENCE_SLOTS", "MAX_SHM_REGIONS", "MAX_STATE_RANK",
    "MAX_TRAFFIC_WEIGHT", "OPTION_KINDS", "SEQUENCE_STRATEGIES", "SEQUENCE_UNUSED_BATCHING_KEYS",
    "STATE_DTYPES", "BatchingConfig", "CacheConfig", "ConfigError", "ConstantConfig",
    "ControlConfig", "LumenConfig", "Option", "Reader", "SequenceConfig", "ServerConfig",
    "Setting", "StateConfig", "TaskConfig", "VersionConfig", "effective_sequence",
    "load_config", "model_root", "parse_config", "parse_task", "read_options", "read_settings",
    "read_toml", "setting", "settings_of", "settings_table", "task_versions", "traffic_weight",
]
