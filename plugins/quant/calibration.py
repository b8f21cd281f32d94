"""Calibration for GPTQ: text sampled from the model itself, and the layer-by-layer
pass that feeds each ``Linear`` its inputs and quantizes it.

**Data (data-free).** The calibration tokens are sampled from the unquantized model
(temperature 1, top-p 0.95, a fixed seed): half the sequences start from the
tokenizer's BOS token alone (raw text, as in pre-training), half from short generic
chat requests (``PROMPTS``), so both the chat template's tokens and free text are
seen. Nothing comes from the eval text or the golden prompts, so ``tokenloom eval``
measures held-out quality; and text the model itself finds likely is what it will
mostly be asked to continue.

**Sequential.** Decoder layer ``i`` is calibrated on the outputs of layers ``< i``
already quantized, and inside a layer each ``Linear`` on the inputs produced by the
ones before it already quantized (q/k/v, then o, then gate/up, then down: the order
the forward calls them in, recorded on a first pass). The layers are the model's own
modules, run outside the engine with a causal attention over one sequence at a time
(``CausalAttention``); the forward stops at the ``Linear`` being captured.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.logging import get_logger
from tokenloom.plugins.models.layers import Linear
from tokenloom.plugins.quant.gptq import DAMPING, Grid, gptq
from tokenloom.protocols.components.attention import ForwardContext

log = get_logger(__name__)

PROMPTS = (
    "Tell me something interesting.",
    "Write a few paragraphs about any topic you like.",
    "Explain something you know well.",
    "Write a short program and explain it.",
    "Tell me a story.",
    "Describe a place.",
    "Give me some advice.",
    "Write a letter to a friend.",
)
PERIOD = 2 * len(PROMPTS)  # sequence i: BOS alone (i even) or PROMPTS[(i // 2) % len]


def sample_calibration_tokens(
    model: str,
    num_tokens: int,
    seq_len: int = 256,
    seed: int = 0,
    cache: str | Path | None = None,
    device: str = "cpu",
) -> list[list[int]]:
    """Token sequences of ``seq_len`` (prompt included), ``num_tokens`` in all
    (rounded up to whole sequences), sampled from ``model`` in float32 on ``device``
    (the engine's torch attention; a seed draws other text on another device).

    ``cache``: a JSON file of sequences sampled before. Where it exists, it must be
    of the same model and ``seq_len``, and hold the sequences asked for: sequence ``i``
    of a sample is drawn with seed ``seed + i`` and a prompt that repeats every
    ``PERIOD`` sequences, whatever the count, so a cache of seed ``s`` serves seed ``s
    + j * PERIOD`` from its sequence ``j * PERIOD`` on (whichever device sampled it).
    Where it does not exist, the sample is written there."""
    count = max(2, -(-num_tokens // seq_len))
    key = {"model": str(Path(model).resolve()), "seq_len": seq_len, "seed": seed}
    if cache is not None and Path(cache).exists():
        saved = json.loads(Path(cache).read_text())
        offset = seed - saved.get("seed", seed)
        differ = [k for k in ("model", "seq_len") if saved.get(k) != key[k]]
        differ += ["seed"] if offset < 0 or offset % PERIOD else []
        if differ or offset + count > len(saved["sequences"]):
            raise ValueError(
                f"calibration cache {cache}: "
                + (f"{', '.join(differ)} differ" if differ else f"holds fewer than {count}")
                + f" (it has {dict((k, saved.get(k)) for k in key)}, "
                f"{len(saved['sequences'])} sequences; it also serves seeds a multiple of "
                f"{PERIOD} above its own)"
            )
        return [list(s) for s in saved["sequences"][offset : offset + count]]
    sequences = _sample(model, count, seq_len, seed, device)
    if cache is not None:
        Path(cache).write_text(json.dumps({**key, "sequences": sequences}))
    return sequences


def _sample(model: str, count: int, seq_len: int, seed: int, device: str) -> list[list[int]]:
    from tokenloom import LLM, SamplingParams

    llm = LLM(model, dtype="float32", attention="torch", device=device, enable_prefix_caching=False)
    try:
        tok = llm.tokenizer
        start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        assert start is not None, "the tokenizer has neither a BOS nor an EOS token"
        prompts: list[list[int]] = []
        for i in range(count):
            if i % 2 == 0:
                prompts.append([start])
            else:
                message = [{"role": "user", "content": PROMPTS[(i // 2) % len(PROMPTS)]}]
                text = tok.apply_chat_template(message, add_generation_prompt=True)
                prompts.append(tok.encode(text, add_special_tokens=False))
        params = [
            SamplingParams(
                temperature=1.0,
                top_p=0.95,
                seed=seed + i,
                max_tokens=seq_len - len(p),
                ignore_eos=True,  # past an end, the model starts a new text
            )
            for i, p in enumerate(prompts)
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
        del llm
        if torch.device(device).type == "cuda":  # the sampler's weights and KV pool: give
            gc.collect()  # them back before the float32 model loads there
            torch.cuda.empty_cache()
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


class CausalAttention:
    """The ``ctx.attn`` of a calibration forward: causal attention over the tokens
    of one sequence, no KV cache (``k_cache``/``v_cache`` and ``meta`` unused)."""

    accepts_written_kv = False
    accepts_rope = False  # the model rotates q and k (on a GPU too)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, **_):  # type: ignore[no-untyped-def]
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=scale)
        return out.transpose(0, 1)


class _Stop(Exception):
    """Raised by a capture hook: the rest of the layer's forward is not needed."""


@dataclass
class LayerStates:
    """The decoder's stream before one layer, per sequence: ``(hidden, residual)``
    as the Llama-family layers pass them (``residual`` None before the first)."""

    rope: list[tuple[torch.Tensor, torch.Tensor]]
    hidden: list[torch.Tensor]  # per sequence [T, hidden] float32
    residual: list[torch.Tensor | None] = field(default_factory=list)


def model_device(model: nn.Module) -> torch.device:
    """The device a loaded model's weights are on (its embedding's)."""
    return model.model.embed_tokens.weight.device


@torch.no_grad()
def quantize_sequentially(
    model: nn.Module,
    sequences: list[list[int]],
    make_grid: Callable[[], Grid],
    damping: float = DAMPING,
    act_order: bool = False,
    prepare_layer: Callable[[int, nn.Module, Callable[[], None]], None] | None = None,
) -> dict[str, Grid]:
    """GPTQ every ``Linear`` of ``model.model.layers`` in place (its ``weight`` now
    holds the rounded values), calibrated on ``sequences``; returns each one's grid
    (its codes and parameters), by module name.

    ``prepare_layer(index, layer, run)`` (optional, e.g. ``awq.AwqScaler``) may change
    each layer's float weights before they are rounded; ``run()`` makes the layer's
    forward over every sequence (on the outputs of the layers before it, quantized)."""
    inner = model.model
    ctx = ForwardContext(
        attn=CausalAttention(),  # type: ignore[arg-type]
        meta=None,  # type: ignore[arg-type]
        kv_caches=[(torch.empty(0), torch.empty(0))] * len(inner.layers),
    )
    states = LayerStates(rope=[], hidden=[], residual=[])
    device = model_device(model)
    for seq in sequences:
        ids = torch.tensor(seq, dtype=torch.long, device=device)
        states.rope.append(inner.rotary(torch.arange(len(seq), device=device)))
        states.hidden.append(inner.embed_tokens(ids).float())
        states.residual.append(None)
    grids: dict[str, Grid] = {}
    for index, layer in enumerate(inner.layers):
        prefix = f"model.layers.{index}."
        if prepare_layer is not None:
            prepare_layer(index, layer, lambda layer=layer: _run(layer, states, ctx))
        for name, linear in _call_order(layer, states, ctx):
            h = _capture(layer, linear, states, ctx)
            grid = make_grid()
            linear.weight.data.copy_(
                gptq(linear.weight.data, h, grid, damping, act_order=act_order)
            )
            grids[prefix + name] = grid
        for i in range(len(states.hidden)):
            states.hidden[i], states.residual[i] = layer(
                states.rope[i], states.hidden[i], states.residual[i], ctx
            )
        log.info("GPTQ: layer %d of %d quantized", index + 1, len(inner.layers))
    return grids


def _run(layer: nn.Module, states: LayerStates, ctx: ForwardContext) -> None:
    for i in range(len(states.hidden)):
        layer(states.rope[i], states.hidden[i], states.residual[i], ctx)


def _call_order(
    layer: nn.Module, states: LayerStates, ctx: ForwardContext
) -> list[tuple[str, Linear]]:
    """The layer's ``Linear`` modules in the order its forward calls them."""
    names = {id(m): n for n, m in layer.named_modules() if isinstance(m, Linear)}
    order: list[tuple[str, Linear]] = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, _: order.append((names[id(mod)], mod)))
        for n, m in layer.named_modules()
        if isinstance(m, Linear)
    ]
    try:
        rope = tuple(t[:1] for t in states.rope[0])
        layer(rope, states.hidden[0][:1], _first(states.residual[0]), ctx)
    finally:
        for hook in hooks:
            hook.remove()
    return order


def _first(residual: torch.Tensor | None) -> torch.Tensor | None:
    return None if residual is None else residual[:1]


def _capture(
    layer: nn.Module, linear: Linear, states: LayerStates, ctx: ForwardContext
) -> torch.Tensor:
    """``sum X^T X`` (float64) of ``linear``'s inputs over every sequence."""
    k = linear.in_features
    h = torch.zeros(k, k, dtype=torch.float64, device=linear.weight.device)

    def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].reshape(-1, k).float()
        h.add_((x.t() @ x).double())
        raise _Stop

    handle = linear.register_forward_pre_hook(hook)
    try:
        for i in range(len(states.hidden)):
            with contextlib.suppress(_Stop):
                layer(states.rope[i], states.hidden[i], states.residual[i], ctx)
    finally:
        handle.remove()
    return h
