"""Load a Hugging Face checkpoint directory into a tokenloom model.

``load_model(model_dir, dtype, device)`` reads config.json, picks the model class
by ``architectures[0]``, builds it with empty tensors directly on the target device
and dtype, then streams each safetensors tensor into its parameter (one tensor in
host memory at a time, converted by the copy; never a full float32 model). Every
checkpoint tensor must land in exactly one parameter slot and every slot must be
filled, else a ``CheckpointError`` names the tensors.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenloom.plugins.models.gguf import SOURCE_KEY, find_gguf
from tokenloom.plugins.models.layers import DEFERRED, Linear, Slots, WeightSlot
from tokenloom.protocols.components.model import Model, ModelInfo
from tokenloom.text.tokenizer import model_eos_token_ids

ModelLookup = Mapping[str, Callable[..., Any]] | Callable[[str], Callable[..., Any] | None]
Loaded = Callable[[str, Linear], None]

_MAX_LISTED = 8


class CheckpointError(ValueError):
    """A checkpoint file or tensor does not match the model; the message names it."""


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    registry: ModelLookup | None = None,
    random_weights: bool = False,
    prepare: Callable[[nn.Module, dict[str, Any]], None] | None = None,
    loaded: Loaded | None = None,
) -> tuple[nn.Module, ModelInfo]:
    """Build the model of ``model_dir`` on ``device`` in ``dtype`` and load its weights.

    ``registry`` maps an architecture name to a factory ``(hf_config, dtype) ->
    nn.Module``: a mapping, or a callable returning None (or raising KeyError) for
    unknown names; default: the built-in ``MODEL_FACTORIES``. The model is returned
    in eval mode without autograd. Raises ValueError for an unknown architecture,
    FileNotFoundError for a missing config or weights, CheckpointError for bad files
    or tensors. ``random_weights`` skips the checkpoint and fills the weights with
    random values (benchmarks of real shapes: speed does not depend on the values).
    ``model_dir`` may also be a GGUF file or a directory holding one (see
    ``plugins.models.gguf``). ``prepare(model, hf_config)`` runs after the model is
    built and before its weights load (a quant method's ``prepare_model``; for a GGUF
    file, ``hf_config[gguf.SOURCE_KEY]`` is its path). The model
    is built for the current ``plugins.models.parallel`` group: each rank reads only
    its shard of every tensor. With ``loaded(name, layer)`` (a quant method that
    ``streams_layers``) each ``Linear``'s dense weight is allocated at its first write
    (``deferred_weights``) and ``loaded`` runs once all of the layer's tensors are in,
    before the next layers load: quantized there, the dense model is never whole.
    """
    root = files_root = Path(model_dir)
    weight_files: list[Path] | None = None
    if (gguf_file := find_gguf(root)) is not None:  # converted once into the cache
        from tokenloom.plugins.models.gguf.checkpoint import converted_dir, converted_weights

        if random_weights:
            files_root = converted_dir(gguf_file)
        else:
            files_root, weights = converted_weights(gguf_file, dtype)
            weight_files = [weights]
    hf_config = read_hf_config(files_root)
    if gguf_file is not None and not random_weights:
        hf_config[SOURCE_KEY] = str(gguf_file)
    architecture = _architecture(hf_config, files_root)
    factory = _lookup_factory(architecture, registry)
    target = torch.device(device)
    with torch.device(target), deferred_weights(loaded is not None):
        model = factory(hf_config, dtype)
    if prepare is not None:
        prepare(model, hf_config)
    if random_weights:
        randomize_weights(model, loaded=loaded)
    else:
        load_weights(model, weight_files or checkpoint_files(root), loaded)
    model.eval().requires_grad_(False)
    info = model_info_from_config(hf_config, name=str(root), dtype=dtype, device=target)
    info.eos_token_ids = model_eos_token_ids(files_root)
    return model, info


# Random weights' greedy output must not depend on the kernel path (see randomize_weights).
_EMBED_STD = 64.0  # the embedding dominates the residual stream (layers add ~10-30 rms)
_HEAD_MARGIN = 64.0  # nats: the successor's logit; the other logits have std 64 / sqrt(dim)


@contextmanager
def deferred_weights(on: bool = True) -> Iterator[None]:
    """Inside, ``Linear`` layers get their dense weight at the first write
    (``Linear.materialize_weight``), not when built."""
    token = DEFERRED.set(on)
    try:
        yield
    finally:
        DEFERRED.reset(token)


def _linears(model: nn.Module) -> dict[int, tuple[str, Linear]]:
    """Each ``Linear``'s own parameters (by id) -> its name and module."""
    return {
        id(p): (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Linear)
        for p in module.parameters(recurse=False)
    }


class _Completion:
    """Runs ``loaded(name, layer)`` once every slot of a ``Linear``'s parameters is
    filled (its weight, bias, a checkpoint's quantized tensors)."""

    def __init__(self, model: nn.Module, slots: Slots, loaded: Loaded | None) -> None:
        linears = _linears(model) if loaded is not None else {}
        self.owner = {
            key: linears[id(s.param)] for key, s in slots.items() if id(s.param) in linears
        }
        self.remaining = Counter(name for name, _ in self.owner.values())
        self.loaded = loaded

    def filled(self, key: str) -> None:
        if (owner := self.owner.get(key)) is not None and self.loaded is not None:
            self.remaining[owner[0]] -= 1
            if self.remaining[owner[0]] == 0:
                try:
                    self.loaded(*owner)
                except Exception as exc:  # through load_weights' file errors as it is
                    raise _HandOnError from exc


class _HandOnError(Exception):
    """An error of ``loaded`` (quantizing a layer): ``load_weights`` re-raises its cause."""


@torch.no_grad()
def randomize_weights(model: nn.Module, std: float = 0.02, loaded: Loaded | None = None) -> None:
    """Normal(0, std) matrices and biases; norm weights (1-D, named *norm*) set to one.

    Then, for an untied LM head, the greedy output is made robust (issue #11): with
    std 0.02 everywhere the logits are N(0, (0.02 sqrt(dim))^2) over the vocabulary
    (std 1.3 at dim 4096), the top-2 gap of the max of 128k Gaussians is about
    std / sqrt(2 ln 128k) = 0.27 nats on average (exponential, so often ~0.01), and the
    argmax flips with the bf16 noise of another kernel path (prefix-cache hit, verify
    steps): a rescaled head alone would not help (the noise scales with it). So the
    embedding gets std ``_EMBED_STD`` (pre-norm layers add the same ~10-30 rms whatever
    it is, so the final norm's input points along the last token's embedding, cosine
    ~0.9), and the head's row ``j`` is the embedding row ``perm[j]`` scaled to
    ``_HEAD_MARGIN / sqrt(dim)``: token ``t`` is followed by ``perm^-1(t)`` with a logit
    of ~``_HEAD_MARGIN * 0.9`` against a maximum of the others of ~5 * 64 / sqrt(dim)
    (5 at dim 4096): a margin of tens of nats, far beyond bf16 noise. The output is a
    walk along a random permutation (no repeats, no EOS preference); speed does not
    depend on the values. Tied heads are left as they are (the head would predict the
    last token again, and a tied random draft model would then always be right).
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(0)
    linears = _linears(model)
    pending: tuple[str, Linear] | None = None  # the Linear filled last, not yet handed on
    for name, param in model.named_parameters():
        owner = linears.get(id(param))
        if pending is not None and loaded is not None and (owner is None or owner != pending):
            loaded(*pending)
        pending = owner
        if owner is not None:
            owner[1].materialize_weight()  # a deferred weight (the same values, in order)
        if param.dim() == 1 and "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
    if pending is not None and loaded is not None:
        loaded(*pending)
    inner = getattr(model, "model", model)
    embed, head = getattr(inner, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is None or head is None or head is embed:
        return
    _successor_head(embed, head, device)


def _successor_head(embed: nn.Module, head: nn.Module, device: torch.device) -> None:
    """Embedding ~ N(0, _EMBED_STD); head row j = embedding row perm[j], norm
    _HEAD_MARGIN / sqrt(dim). Built in full on every rank (the same seed) and sliced to
    each rank's vocab rows, so tensor-parallel shards agree."""
    weights = [getattr(m, "weight", None) for m in (embed, head)]
    vocab = getattr(embed, "num_embeddings", None)
    if vocab is None or any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in weights):
        return
    embed_w, head_w = weights
    dim = embed_w.shape[1]
    if head_w.shape[1] != dim or not embed_w.is_floating_point() or not head_w.is_floating_point():
        return
    generator = torch.Generator(device=device).manual_seed(1)
    full = torch.empty(vocab, dim, device=device, dtype=torch.float32)
    full.normal_(0.0, _EMBED_STD, generator=generator)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1)).to(device)
    rows = full[perm]
    rows *= (_HEAD_MARGIN / dim**0.5) / rows.norm(dim=1, keepdim=True)
    for module, weight, source in ((embed, embed_w, full), (head, head_w, rows)):
        start, _ = getattr(module, "vocab_range", (0, vocab))
        real = max(0, min(weight.shape[0], vocab - start))
        weight.zero_()
        weight[:real].copy_(source[start : start + real])
    del full, rows
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the KV cache is sized from the free memory after loading


def read_hf_config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the model directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read config: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def model_info_from_config(
    hf_config: dict[str, Any],
    *,
    name: str = "",
    dtype: Any = None,
    device: Any = None,
) -> ModelInfo:
    """The engine's view of a Hugging Face config. ``max_model_len`` is
    ``max_position_embeddings``, capped by a sliding window when one is enabled
    (the models attend over the full context, which equals the window only up to
    its size)."""
    num_heads = hf_config["num_attention_heads"]
    max_len = int(hf_config.get("max_position_embeddings", 4096))
    window = hf_config.get("sliding_window")
    if window and hf_config.get("use_sliding_window", True):
        max_len = min(max_len, int(window))
    eos = hf_config.get("eos_token_id")
    return ModelInfo(
        name=name,
        architecture=_architecture(hf_config, Path(name)),
        max_model_len=max_len,
        vocab_size=hf_config["vocab_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads,
        hidden_size=hf_config["hidden_size"],
        dtype=dtype,
        device=device,
        eos_token_ids=[i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)],
    )


def checkpoint_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else all of them."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: cannot read the weight map: {exc}") from exc
        files = [root / name for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {index.name} but missing")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors weights")
    return files


def load_weights(model: Model, files: list[Path], loaded: Loaded | None = None) -> None:
    """Copy every tensor of ``files`` into the slot ``model.checkpoint_slots()`` names
    for it, converting dtype and device on the way; ``loaded(name, layer)`` once a
    ``Linear``'s tensors are all in (``load_model``)."""
    from safetensors import safe_open

    slots = model.checkpoint_slots()
    completion = _Completion(model, slots, loaded)  # type: ignore[arg-type]
    done: set[str] = set()
    unexpected: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    slot = slots.get(name)
                    if slot is None:
                        if not model.ignores_checkpoint_tensor(name):
                            unexpected.append(name)
                        continue
                    if name in done:
                        raise CheckpointError(f"{path.name}: tensor {name!r} appears twice")
                    tensor = _read(reader, name, slot, path)
                    target = slot.target()
                    if tensor.numel() == 1 == target.numel():  # a scale stored as [] or [1]
                        tensor = tensor.reshape(target.shape)
                    if tensor.shape != target.shape:
                        raise CheckpointError(
                            f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(target.shape)}"
                        )
                    target.copy_(tensor)
                    done.add(name)
                    completion.filled(name)
        except CheckpointError:
            raise
        except _HandOnError as err:  # not the file's fault: the method's own error
            raise err.__cause__ from None  # type: ignore[misc]
        except Exception as exc:  # safetensors reports a corrupt header as its own error
            raise CheckpointError(f"{path}: cannot read safetensors file: {exc}") from exc
    if unexpected:
        raise CheckpointError(f"checkpoint tensors the model does not have: {_list(unexpected)}")
    missing = [name for name in slots if name not in done]
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors: {_list(missing)}")


def _read(reader: Any, name: str, slot: WeightSlot, path: Path) -> torch.Tensor:
    """The tensor ``name``, or only the range ``slot.source`` names (a rank's shard)."""
    if slot.source is None:
        return reader.get_tensor(name)
    dim, begin, end = slot.source
    view = reader.get_slice(name)
    shape = list(view.get_shape())
    if dim >= len(shape) or shape[dim] != slot.source_size:
        raise CheckpointError(
            f"{path.name}: tensor {name!r} has shape {tuple(shape)}, the model expects "
            f"{slot.source_size} along dim {dim}"
        )
    index = [slice(None)] * len(shape)
    index[dim] = slice(begin, end)
    return view[tuple(index)]


def _architecture(hf_config: dict[str, Any], root: Path) -> str:
    names = hf_config.get("architectures")
    if not names or not isinstance(names, list):
        raise ValueError(f"{root / 'config.json'}: no 'architectures' entry")
    return str(names[0])


def _lookup_factory(architecture: str, registry: ModelLookup | None) -> Callable[..., Any]:
    if registry is None:
        from tokenloom.plugins.models import MODEL_FACTORIES

        registry = MODEL_FACTORIES
    if isinstance(registry, Mapping):
        factory = registry.get(architecture)
        supported = ", ".join(sorted(registry))
    else:
        try:
            factory = registry(architecture)
        except KeyError:
            factory = None
        supported = "see `tokenloom plugins`, kind 'model'"
    if factory is None:
        raise ValueError(f"unknown model architecture {architecture!r}; supported: {supported}")
    return factory


def _list(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")
