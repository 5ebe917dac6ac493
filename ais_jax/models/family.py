"""What a model family is: the one interface the rollout engines, the trainer and the loaders use.

A family is a frozen record of pure functions and names (`Family`), defined once at the end of
its own module (``qwen3.FAMILY``, ``qwen35.FAMILY``, ``llada.FAMILY``) and listed once in
`ais_jax.models.FAMILIES`. Code outside a family never branches on a family's config type: it
asks `ais_jax.models.family_of(config)` for the record and calls what it holds, or reads its
``kind`` (``"autoregressive"``: the KV-cache sampler and the token log-probs; ``"diffusion"``:
the masked-diffusion sampler and estimator) and its optional parts (``None`` where a family has
no such thing: a diffusion model has no KV cache, Qwen3.5 runs no shared-prompt scoring).

Checkpoint tensors are described by `TensorName`: the Hugging Face name of each tensor, the
entry of our tree it fills (a top-level name, or a per-layer name and the index into that
name's stack) and the shape the file holds it in, so one loader and one writer
(`ais_jax.io.hf`) serve every family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

KINDS = ("autoregressive", "diffusion")


class TensorName(NamedTuple):
    """Where one checkpoint tensor goes: ``params[ours]`` (``layer`` None) or entry ``layer``
    of the stack ``params["layers"][ours]``; ``shape``: the tensor's shape in the file (a
    stack entry is reshaped to ours, e.g. Qwen3.5's conv ``[W, 1, X]`` to ``[W, X]``)."""

    ours: str
    layer: int | None
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One model family (module docstring). Every callable takes the family's config.

    name             ``model.family`` in a YAML (`config.FAMILIES` lists the names)
    kind             "autoregressive" or "diffusion" (`KINDS`)
    config_class     the frozen dataclass of its hyper-parameters, with ``preset(name,
                     **overrides)``, ``from_hf_dict(hf, source=)`` and ``to_hf_dict(dtype=)``
    presets          the preset names ``config_class.preset`` resolves
    architectures    the ``config.json`` "architectures" entries it reads
    model_types      the ``config.json`` "model_type" values it reads
    init_params(config, key, dtype) -> params
    forward(params, config, tokens_BS, mask_BS=None) -> logits_BSV (float32)
    tensor_names(config) -> {Hugging Face name: TensorName}
    projections      the matmul weights a quantized rollout copy holds as `QArray`s
    head_name        the checkpoint name of an untied LM head (a tied checkpoint may carry a
                     copy of the embedding there, which the loader drops)
    final_hidden(params, config, tokens_BS, mask_BS=None, *, remat=False) -> hidden_BSD
    response_hidden(params, config, prompts_NP, prompt_mask_NP, tokens_BT, mask_BT, *,
                    remat=False) -> hidden_BTD: each prompt run once for its group of rows
                    (None: the family scores full rows)
    init_cache(config, batch, max_len, dtype) -> cache
    forward_cached(params, config, tokens_BQ, cache, mask_BQ=None, *, last_only=False)
        -> (logits_BQV, cache)                      (both None for a diffusion family)
    fuse_projections(layer_params, config) -> layer_params with q/k/v and gate/up fused
                    (None: the decode layouts' ``fused`` keeps this family's apart)
    unstack_layers(params, config) -> params with ``layers`` a per-layer list (None: one
                    stack of identical layers, `nn.layers.unstack_layers`)
    file_tensors(path, tensors) -> tensors: a checkpoint's tensors renamed to
                    ``tensor_names``' (a multimodal wrapper's text model; None: as read)
    """

    name: str
    kind: Literal["autoregressive", "diffusion"]
    config_class: type
    presets: tuple[str, ...]
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    init_params: Callable[..., Any]
    forward: Callable[..., Any]
    tensor_names: Callable[[Any], Mapping[str, TensorName]]
    projections: tuple[str, ...]
    head_name: str
    final_hidden: Callable[..., Any] | None = None
    unstack_layers: Callable[..., Any] | None = None
    response_hidden: Callable[..., Any] | None = None
    init_cache: Callable[..., Any] | None = None
    forward_cached: Callable[..., Any] | None = None
    fuse_projections: Callable[..., Any] | None = None
    file_tensors: Callable[..., Any] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Family {self.name!r}: kind {self.kind!r} is not one of {KINDS}.")
        decoding = (self.final_hidden, self.init_cache, self.forward_cached)
        if self.kind == "autoregressive" and None in decoding:
            raise ValueError(
                f"Family {self.name!r}: an autoregressive family needs final_hidden, "
                "init_cache and forward_cached."
            )


def hf_layer_names(
    top: Mapping[str, str],
    layer: Mapping[str, str],
    shapes: Mapping[str, Any],
    indices: Callable[[str], Any],
    prefix: Callable[[int], str] = "model.layers.{}.".format,
    file_shape: Callable[[str, tuple[int, ...]], tuple[int, ...]] = lambda name, shape: shape,
) -> dict[str, TensorName]:
    """`Family.tensor_names` of a tree whose top-level names map through ``top`` and whose
    per-layer stack ``name`` holds checkpoint layers ``indices(name)`` (entry j of the stack is
    checkpoint layer ``indices(name)[j]``), each called ``prefix(i) + layer[name]``.
    ``shapes``: the tree of `jax.ShapeDtypeStruct`s; ``file_shape(name, shape)`` the file's
    shape of one entry (default: ours)."""
    names = {
        hf: TensorName(ours, None, tuple(shapes[ours].shape))
        for ours, hf in top.items()
        if ours in shapes
    }
    for ours, sds in shapes["layers"].items():
        shape = file_shape(ours, tuple(sds.shape[1:]))
        for j, i in enumerate(indices(ours)):
            names[prefix(i) + layer[ours]] = TensorName(ours, j, shape)
    return names
