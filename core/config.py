"""The engine's one typed configuration: TOML file, then CLI flags, then validation.

Every field is flat so that each maps to one CLI flag (``max_num_seqs`` ->
``--max-num-seqs``). Invalid values fail at start-up with the field's name and the
allowed range. Plugin-specific settings go in the ``[plugin.NAME]`` tables.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

if TYPE_CHECKING:
    from tokenloom.protocols.sampling import SamplingParams

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "random")
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
DISTRIBUTED_BACKENDS = ("auto", "nccl", "gloo")


class ConfigError(ValueError):
    """A config value is invalid; the message names the field."""


def default_block_size(kv_cache_dtype: str, num_blocks: int | None = None) -> int:
    """``block_size = 0``'s value: 64 tokens for an fp8 cache sized from memory, else 16
    (a pool of ``num_blocks`` given keeps the 16-token blocks it was sized in: four times
    the tokens would be four times the memory)."""
    return 64 if kv_cache_dtype in ("fp8", "fp8_e4m3") and num_blocks is None else 16


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # model
    model: str = ""  # Hugging Face directory; "" = the built-in default model
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None: from config.json
    load_format: str = "auto"  # auto: the checkpoint's safetensors; random: random weights
    # parallelism: one worker process per rank; heads and MLP columns split across ranks
    tensor_parallel_size: int = 1
    distributed_backend: str = "auto"  # auto: nccl on CUDA, gloo on the CPU
    # components (kind = name)
    scheduler: str = "continuous"
    kv_cache: str = "paged"
    attention: str = "auto"  # auto: triton on CUDA, torch elsewhere
    quant: str = "none"
    # also quantize the LM head (the logits' projection, 1 GB of Llama-3-8B's 4.8 GB in
    # int4) with the weight method; a tied embedding keeps its 16-bit copy for lookups.
    # None: the method's default (int8 on; fp8 and int4 off: their heads cost quality)
    quant_lm_head: bool | None = None
    executor: str = "model"
    proposer: str = "none"
    frontends: list[str] = msgspec.field(default_factory=lambda: ["openai"])
    # KV cache and scheduling
    # tokens a KV block (a page). 0: 64 for an fp8 cache sized from memory (no num_blocks),
    # whose fp8-MMA decode reads pages of 64 about 10% faster than pages of 16 (session
    # 51, docs/quantization.md), else 16
    block_size: int = 0
    num_blocks: int | None = None  # None: sized from memory
    kv_cache_memory_gb: float = 1.0  # CPU budget for the KV pool
    gpu_memory_utilization: float = 0.90
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8 | int8: quantized KV cache
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_waiting_requests: int = 4096
    # executor
    enforce_eager: bool = False
    # decode steps of up to this many requests replay CUDA graphs (captured at start-up
    # in buckets of 16); larger ones run eagerly. Raise it with max_num_seqs above 512.
    max_graph_batch: int = 512
    # Build and launch step N+1 while step N runs on the device (the engine reads
    # step N's tokens afterwards). None: on for CUDA, off elsewhere (no overlap there).
    async_scheduling: bool | None = None
    # speculative decoding: the proposer (config ``proposer``) drafts this many tokens
    # per step; a request may set its own (SamplingParams); 0 turns it off
    num_speculative_tokens: int = 0
    draft_model: str = ""  # the ``draft`` proposer's model (HF directory or GGUF)
    # verify steps whose every request has 1 + num_speculative_tokens tokens replay CUDA
    # graphs for up to this many requests (the decode buckets); 0: verify eagerly
    max_verify_graph_seqs: int = 64
    # serving
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    zmq_endpoint: str = "tcp://127.0.0.1:5557"
    request_timeout_s: float | None = None
    shutdown_grace_s: float = 5.0
    engine_start_timeout_s: float = 600.0
    # limits every frontend applies alike (HTTP and ZeroMQ), checked before any work
    max_request_body_mb: float = 16.0  # HTTP bodies and ZeroMQ frames; 413 / error reply
    max_n: int = 128  # choices per request (params.n)
    max_prompts_per_request: int = 256  # prompts in one batched completion request
    max_stop_sequences: int = 16  # entries in stop and in stop_token_ids, each
    max_request_id_bytes: int = 256  # a client's job id (ZeroMQ) or request id, UTF-8
    zmq_heartbeat_timeout_s: float = 30.0  # a silent ZeroMQ client's jobs are aborted
    # engine-core failure policy: restart it with backoff, then give up (exit non-zero)
    restart_engine: bool = True
    max_engine_restarts: int = 5  # consecutive failed starts or deaths before exiting
    metrics_require_api_key: bool = False  # /metrics and /version behind the API key
    record_trace: str = ""  # JSONL request log for `tokenloom sim` (no text); "" = off
    # plugin settings: [plugin.NAME] tables
    plugin: dict[str, dict[str, Any]] = {}

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("device", self.device, DEVICES)
        _choice("load_format", self.load_format, LOAD_FORMATS)
        if self.kv_cache_dtype == "fp8_e4m3":  # vLLM's spelling of the same cache
            self.kv_cache_dtype = "fp8"
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.block_size == 0:
            self.block_size = default_block_size(self.kv_cache_dtype, self.num_blocks)
        _choice("distributed_backend", self.distributed_backend, DISTRIBUTED_BACKENDS)
        _at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        _at_least("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size: must be a power of two, got {self.block_size}")
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("max_graph_batch", self.max_graph_batch, 1)
        _at_least("max_waiting_requests", self.max_waiting_requests, 1)
        _at_least("num_speculative_tokens", self.num_speculative_tokens, 0)
        _at_least("max_verify_graph_seqs", self.max_verify_graph_seqs, 0)
        if self.num_blocks is not None:
            _at_least("num_blocks", self.num_blocks, 1)
        if self.max_model_len is not None:
            _at_least("max_model_len", self.max_model_len, 1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb: must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
        if self.max_request_body_mb <= 0:
            raise ConfigError(f"max_request_body_mb: must be > 0, got {self.max_request_body_mb}")
        for name in ("max_n", "max_prompts_per_request", "max_stop_sequences"):
            _at_least(name, getattr(self, name), 1)
        _at_least("max_request_id_bytes", self.max_request_id_bytes, 8)
        _at_least("max_engine_restarts", self.max_engine_restarts, 0)
        if self.zmq_heartbeat_timeout_s <= 0:
            raise ConfigError(
                f"zmq_heartbeat_timeout_s: must be > 0, got {self.zmq_heartbeat_timeout_s}"
            )
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"shutdown_grace_s: must be >= 0, got {self.shutdown_grace_s}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: must be one of {', '.join(allowed)}; got {value!r}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{name}: must be >= {low}, got {value}")


S = TypeVar("S", bound=msgspec.Struct)


def plugin_settings(config: EngineConfig, name: str, settings: type[S]) -> S:
    """The ``[plugin.NAME]`` table as ``settings`` (a msgspec Struct): its defaults
    for missing keys. Raises ConfigError naming ``plugin.NAME.KEY`` for an unknown
    key (with ``forbid_unknown_fields``) or a bad value."""
    try:
        return msgspec.convert(config.plugin.get(name, {}), settings, strict=False)
    except msgspec.ValidationError as exc:
        message = _friendly(str(exc), f"plugin.{name}.")
        if message.endswith("unknown setting"):
            message += f"; known: {', '.join(settings.__struct_fields__) or '(none)'}"
        raise ConfigError(message) from exc


def speculation_configured(config: EngineConfig) -> bool:
    """Whether the engine speculates at all: a proposer and ``num_speculative_tokens``."""
    return config.num_speculative_tokens > 0 and config.proposer != "none"


def speculative_tokens(config: EngineConfig, params: SamplingParams) -> int:
    """How many drafts a request verifies per step: its own setting, capped by (and
    defaulting to) the engine's ``num_speculative_tokens``; 0 (no speculation) without
    a proposer. The engine (which steps run synchronously) and the executor (which
    requests it drafts for) both ask this."""
    if not speculation_configured(config):
        return 0
    own = params.num_speculative_tokens
    limit = config.num_speculative_tokens
    return limit if own is None else min(own, limit)


def field_names() -> tuple[str, ...]:
    return EngineConfig.__struct_fields__


def load_config(path: str | Path | None = None, **overrides: Any) -> EngineConfig:
    """Read a TOML file (if given), apply ``overrides`` (None values are skipped),
    validate, and return the config. Raises ConfigError naming the bad field."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
        data = _flatten_sections(data)
    for key, value in overrides.items():
        if value is not None:
            data[key] = value
    return make_config(data)


def make_config(data: dict[str, Any]) -> EngineConfig:
    try:
        return msgspec.convert(data, EngineConfig, strict=False)
    except ConfigError:
        raise
    except msgspec.ValidationError as exc:
        raise ConfigError(_friendly(str(exc))) from exc


def _flatten_sections(data: dict[str, Any]) -> dict[str, Any]:
    """Allow ``[components]`` / ``[engine]`` / ``[server]`` tables as pure grouping."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in ("components", "engine", "server", "model_options"):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def _friendly(message: str, prefix: str = "") -> str:
    # msgspec says "Expected `int`, got `str` - at `$.max_num_seqs`"; lead with the field.
    if " - at `$." in message:
        text, _, where = message.partition(" - at `$.")
        return f"{prefix}{where.rstrip('`')}: {text}"
    if message.startswith("Object contains unknown field `"):  # forbid_unknown_fields
        key = message.split("`")[1]
        return f"{prefix}{key}: unknown setting"
    return f"{prefix.rstrip('.')}: {message}" if prefix else message
