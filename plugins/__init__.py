"""The default components. Each module listed here is a pluggy plugin registered
exactly as a third-party one would be (through ``tokenloom_register_components``)."""

BUILTIN_PLUGINS = (
    "tokenloom.plugins.kv_cache.paged",
    "tokenloom.plugins.scheduler.continuous",
    "tokenloom.plugins.attention.torch_backend",
    "tokenloom.plugins.attention.triton_backend",
    "tokenloom.plugins.quant.none",
    "tokenloom.plugins.quant.fp8",
    "tokenloom.plugins.quant.int8",
    "tokenloom.plugins.quant.int4",
    "tokenloom.plugins.proposer.none",
    "tokenloom.plugins.proposer.ngram",
    "tokenloom.plugins.proposer.draft",
    "tokenloom.plugins.executor.plugin",
    "tokenloom.plugins.models",
    "tokenloom.plugins.frontends.openai",
    "tokenloom.plugins.frontends.zmq",
    "tokenloom.contrib.schedulers.static",
    "tokenloom.contrib.proposers.replay",
)
