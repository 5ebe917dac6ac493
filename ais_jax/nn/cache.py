"""The KV cache of the attention layers: its pytree, layouts and in-place slot writes.

Keys are held as ``[B, K, S, E]`` and values as ``[B, K, E, S]`` (`layers.attention`'s
layouts), one array per layer so a decode step updates and reads each layer's cache in place;
S slots are filled left to right. A family's ``init_cache`` sizes one (`empty`); a family with
other state per layer (Qwen3.5's recurrent layers) wraps it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Keys/values of every layer for a batch of rows; its S slots are filled left to right.

    k: one ``[B, K, S, E]`` array per layer; v: one ``[B, K, E, S]`` array per layer (the
    layouts of `attention`; per-layer arrays so a decode step updates and reads each layer's
    cache in place); valid: ``[B, S]`` slots holding a real token; next_pos: ``[B]`` position of
    each row's next token; index: the next free slot (same for every row).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array
    next_pos: jax.Array
    index: jax.Array


def cache_layout(k_BSKE: jax.Array, v_BSKE: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Projected keys/values ``[B, S, K, E]`` in `attention`'s layouts: ``[B, K, S, E]`` and
    ``[B, K, E, S]``."""
    return k_BSKE.transpose(0, 2, 1, 3), v_BSKE.transpose(0, 2, 3, 1)


def _write_slots(cache: jax.Array, update: jax.Array, index: tuple) -> jax.Array:
    """``dynamic_update_slice`` of ``update`` (cast to the cache's dtype) into ``cache``. A
    16-bit float cache is updated through its bits: XLA:CPU runs a bfloat16
    dynamic-update-slice in float32, over a converted copy of the whole cache, at every step."""
    update = update.astype(cache.dtype)
    if cache.dtype.itemsize != 2 or not jnp.issubdtype(cache.dtype, jnp.floating):
        return jax.lax.dynamic_update_slice(cache, update, index)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731
    written = jax.lax.dynamic_update_slice(bits(cache), bits(update), index)
    return jax.lax.bitcast_convert_type(written, cache.dtype)


def write_kv(k_BKSE, v_BKES, k_BQKE, v_BQKE, start) -> tuple[jax.Array, jax.Array]:
    """The caches of one layer with the Q projected keys/values ``[B, Q, K, E]`` written to
    slots ``start`` .. ``start + Q - 1`` (keys ``[B, K, S, E]``, values ``[B, K, E, S]``).

    One 16-bit value slot on CPU (a decode step) is written with a select over the whole cache
    rather than a dynamic-update-slice: XLA:CPU's 16-bit update is not in place either way
    (`_write_slots`), and along the values' minor slot axis its element-by-element copy is
    several times slower than the vectorised select (docs/benchmarks.md). The stored
    values are the same.
    """
    k_BKQE, v_BKEQ = cache_layout(k_BQKE, v_BQKE)
    k_BKSE = _write_slots(k_BKSE, k_BKQE, (0, 0, start, 0))
    v_BKEQ = v_BKEQ.astype(v_BKES.dtype)
    if v_BKEQ.shape[-1] == 1 and v_BKES.dtype.itemsize == 2 and jax.default_backend() == "cpu":
        hit_S = jnp.arange(v_BKES.shape[-1]) == start
        return k_BKSE, jnp.where(hit_S, v_BKEQ, v_BKES)
    return k_BKSE, _write_slots(v_BKES, v_BKEQ, (0, 0, 0, start))


def empty(batch: int, layers: int, kv_heads: int, head_dim: int, max_len: int, dtype) -> KVCache:
    """An empty cache of S = ``max_len`` slots per row for ``layers`` attention layers."""
    return KVCache(
        k=tuple(jnp.zeros((batch, kv_heads, max_len, head_dim), dtype) for _ in range(layers)),
        v=tuple(jnp.zeros((batch, kv_heads, head_dim, max_len), dtype) for _ in range(layers)),
        valid=jnp.zeros((batch, max_len), bool),
        next_pos=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )
