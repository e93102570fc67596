"""The Llama-family forward pass (Llama, Mistral, Qwen2, SmolLM) over the paged KV cache.

Tokens of all scheduled sequences are flattened into one batch; K/V are read and written only
through `kvops.kernels` (slot mapping for writes, block tables for reads).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from kvops import kernels
from kvops.engine.linear import Linear, LinearDispatch, select_linear
from kvops.kernels import AttentionMetadata, KVCacheLayer
from kvops.schema.errors import ConfigError

log = structlog.get_logger("kvops.engine.model")

# Sees each layer's new K and V (after RoPE) before they are written to the cache.
KVObserver = Callable[[int, torch.Tensor, torch.Tensor], None]


def _rope_inv_freq(config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, honouring the config's rope parameters."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ConfigError("rope_type 'dynamic' (NTK scaling that changes with length) is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"rope_type {rope_type!r} is not supported: use one of {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE on heads [tokens, heads, head_dim]: `x * cos + rotate_half(x) * sin` with the halves of
    rotate_half's concatenation taken by one roll, the sign it applies kept in `sin_signed` (sin with its
    first half negated). The same bits as transformers' form (a negation is exact), three ops fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def _compiled_layout(layer: KVCacheLayer) -> bool:
    """Whether the compiled ops can read and write this layer's cache: the model dtype, unquantized, K and V each
    in one piece (the block size profile's trial pools are K and V slices of the serving pool's memory)."""
    return layer.kind == "auto" and layer.data[0].is_contiguous() and layer.data[1].is_contiguous()


class Layer:
    """One decoder layer's weights; q/k/v and gate/up are fused so each is one matmul."""

    __slots__ = ("down", "gate_up", "input_norm", "o", "post_norm", "qkv", "qkv_bias")


class LlamaModel:
    """Weights as plain tensors and one `forward` that reads and writes the paged cache."""

    def __init__(self, config: Any, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_positions: int, device: torch.device | None = None, ops: Any = None) -> None:
        """`ops`: the compiled step's ops (kvops/engine/compiled.py), or None for the unfused step."""
        sliding = getattr(config, "sliding_window", None)
        if sliding and getattr(config, "use_sliding_window", True) and sliding < max_positions:
            raise ConfigError(
                f"this model uses sliding-window attention ({sliding} tokens), which the engine does not "
                f"implement: run it with --max-model-len {sliding} or less"
            )
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate_size = config.intermediate_size
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {config.hidden_act!r} is not supported (Llama-family models use silu)")

        # Each tensor is cast and moved on its own, so a GPU run never holds a second full copy on the device.
        def w(name: str) -> torch.Tensor:
            try:
                return state_dict[name].to(self.device, dtype).contiguous()
            except KeyError:
                raise ConfigError(f"weight {name!r} is missing from the checkpoint") from None

        def opt(name: str) -> torch.Tensor | None:
            return state_dict[name].to(self.device, dtype).contiguous() if name in state_dict else None

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in state_dict
        self.lm_head = self.embed if tied else w("lm_head.weight")
        self.layers: list[Layer] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            layer = Layer()
            layer.input_norm = w(p + "input_layernorm.weight")
            layer.post_norm = w(p + "post_attention_layernorm.weight")
            projections = [p + f"self_attn.{name}_proj." for name in "qkv"]
            layer.qkv = torch.cat([w(name + "weight") for name in projections])
            biases = [opt(name + "bias") for name in projections]
            layer.qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None  # type: ignore[misc]
            layer.o = w(p + "self_attn.o_proj.weight")
            layer.gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
            layer.down = w(p + "mlp.down_proj.weight")
            self.layers.append(layer)
        # Chosen on these weights, as a decode step reads them, the head included (kvops/engine/linear.py).
        self.matmul_weights = [*(w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                                self.lm_head]

        inv_freq, scaling = _rope_inv_freq(config)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(self.device, dtype)
        sin = emb.sin() * scaling  # its first half negated, as `apply_rope` takes it
        sin[:, : sin.shape[1] // 2].neg_()
        self.sin_signed = sin.to(self.device, dtype)
        # Unmeasured until `use_compiled`: the engine measures the matmul backends after the KV pool fits, so a
        # configuration that cannot fit is refused without waiting for them.
        self.ops: Any = None
        # The KV layers last seen and their caches when the compiled ops can read them all (None otherwise)
        self._layout_memo: tuple[tuple[KVCacheLayer, ...], list[torch.Tensor] | None] = ((), None)
        self._layer_weights: list[torch.Tensor | None] = []
        self._linear_name, self.linear = select_linear(self.device, dtype)
        self._dispatch: LinearDispatch | None = None
        if ops is not None:
            self.use_compiled(ops)

    @property
    def linear_backend(self) -> str:
        """The matmul backend split now (it can change while serving: kvops/engine/linear.py)."""
        return self._dispatch.name if self._dispatch is not None else self._linear_name

    @property
    def linear_dispatch(self) -> LinearDispatch | None:
        """The matmul dispatch that measures its backends again while serving; None where one backend is fixed."""
        return self._dispatch

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the model keeps (weights and RoPE tables), a tied head counted once."""
        tensors = {id(t): t for t in (self.embed, self.norm, self.lm_head, self.cos, self.sin_signed)}
        for layer in self.layers:
            for name in Layer.__slots__:
                t = getattr(layer, name)
                if t is not None:
                    tensors[id(t)] = t
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One op, the same bits as the steps below in fp32 (tests/test_model.py); in half precision
            # transformers rounds before multiplying by the weight, which F.rms_norm does not.
            return F.rms_norm(x, weight.shape, weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def use_compiled(self, ops: Any) -> None:
        """Run the step with the compiled ops (kvops/engine/compiled.py), or unfused again with None; the matmul
        backends are measured (kvops/engine/linear.py), the compiled fp32 matmul among them."""
        self.ops = ops
        # decode_layers takes the layers' weights as one flat list, seven a layer
        self._layer_weights = [w for layer in self.layers for w in (
            layer.input_norm, layer.qkv, layer.qkv_bias, layer.o, layer.post_norm, layer.gate_up, layer.down)]
        compiled: Linear | None = None
        if ops is not None and self.dtype == torch.float32:
            def compiled(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
                out = ops.gemv(x, w)
                return out if b is None else out + b

        self._linear_name, self.linear = select_linear(self.device, self.dtype, self.matmul_weights, compiled)
        self._dispatch = self.linear if isinstance(self.linear, LinearDispatch) else None

    def _backend_for(self, rows: int) -> str:
        if self._dispatch is not None:
            return self._dispatch.backend_for(rows)
        return self._linear_name

    def _compiled_caches(self, kv_cache: Sequence[KVCacheLayer]) -> list[torch.Tensor] | None:
        """Every layer's cache tensor when the compiled ops can read them all, else None. Remembered for the layers
        last seen, whose layouts never change: checking 30 layers each step cost 60 `aten::select`."""
        layers, caches = self._layout_memo
        if len(layers) != len(kv_cache) or not all(map(operator.is_, layers, kv_cache)):
            layers = tuple(kv_cache)
            caches = [layer.data for layer in layers] if all(map(_compiled_layout, layers)) else None
            self._layout_memo = (layers, caches)
        return caches

    def _decode_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_cache: Sequence[KVCacheLayer], observer: KVObserver | None) -> torch.Tensor | None:
        """All layers in one compiled call, for a step where every token decodes and every layer's cache holds the
        model dtype (the steady state of serving); None for any other step."""
        if self.ops is None or observer is not None or meta.prefills or x.shape[0] != meta.num_decode_tokens:
            return None
        caches = self._compiled_caches(kv_cache)
        if caches is None:
            return None
        rows = x.shape[0]
        backend = self._backend_for(rows)
        x, linear_s = self.ops.decode_layers(
            x, self._layer_weights, caches, positions, self.cos, self.sin_signed,
            meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens, self.num_heads, self.num_kv_heads,
            self.scale, self.eps, backend == "onednn", backend == "compiled")
        if self._dispatch is not None:  # the dispatch watches the time its choice takes
            self._dispatch.account(rows, linear_s)
        return x

    def _attention(self, i: int, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   layer_cache: KVCacheLayer, observer: KVObserver | None,
                   rope: dict[str, torch.Tensor]) -> torch.Tensor:
        """RoPE on q and k, k and v into the cache, attention over the cache: [tokens, heads * head_dim]."""
        tokens, num_decode = qkv.shape[0], meta.num_decode_tokens
        compiled = self.ops is not None and observer is None and _compiled_layout(layer_cache)
        if compiled:  # one op ropes and writes
            q = self.ops.rope_write(qkv, positions, self.cos, self.sin_signed, layer_cache.data, meta.slot_mapping,
                                    self.num_heads, self.num_kv_heads)
        else:
            if not rope:  # once a step, for the first layer that needs them
                rope["cos"] = self.cos[positions].unsqueeze(1)
                rope["sin"] = self.sin_signed[positions].unsqueeze(1)
            qkv = qkv.contiguous()  # heads are viewed out of it below
            # RoPE on q and k heads in one go: they are adjacent in the fused projection.
            qk = qkv[:, : self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = apply_rope(qk, rope["cos"], rope["sin"])
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
            if observer is not None:
                observer(i, k, v)
            kernels.write_kv_cache(k, v, layer_cache, meta.slot_mapping)
        parts = []
        if num_decode and compiled:  # decode rows read their blocks where they lie, a shared prefix once
            parts.append(self.ops.paged_decode(q[:num_decode], layer_cache.data, meta.decode_block_tables,
                                               meta.decode_context_lens, self.scale))
        elif num_decode:
            parts.append(kernels.paged_decode_attention(q[:num_decode], layer_cache, meta, self.scale))
        if meta.prefills:
            parts.append(kernels.paged_prefill_attention(q[num_decode:], layer_cache, meta, self.scale))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        return attn.reshape(tokens, -1)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual `x + delta` (delta None: x as it is) and its RMSNorm."""
        if self.ops is not None:
            return x, self.ops.add_rms_norm(x, delta, weight, self.eps)  # x updated in place
        if delta is not None:
            x = x + delta
        return x, self._rms_norm(x, weight)

    def _mlp_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate) * up

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: Sequence[KVCacheLayer],
        logits_indices: torch.Tensor,
        observer: KVObserver | None = None,
    ) -> torch.Tensor:
        """Run the flat batch; return float32 logits for the tokens at `logits_indices`.

        Inputs may be built on the host: they are moved to the model's device here (no-ops on CPU), once
        per step, so every caller (the engine, the KV profiles, the benchmarks) gets the same handling."""
        device = self.device
        input_ids, positions, logits_indices = (t.to(device, non_blocking=True)
                                                for t in (input_ids, positions, logits_indices))
        meta = meta.to(device)
        linear = self.linear
        rope: dict[str, torch.Tensor] = {}
        x = F.embedding(input_ids, self.embed)
        fused = self._decode_layers(x, positions, meta, kv_cache, observer)
        if fused is not None:
            x = fused
        else:
            delta = None  # what the last sublayer adds to the residual stream x
            for i, layer in enumerate(self.layers):
                x, h = self._add_norm(x, delta, layer.input_norm)
                qkv = linear(h, layer.qkv, layer.qkv_bias)
                attn = self._attention(i, qkv, positions, meta, kv_cache[i], observer, rope)
                x, h = self._add_norm(x, linear(attn, layer.o, None), layer.post_norm)
                delta = linear(self._mlp_activation(linear(h, layer.gate_up, None)), layer.down, None)
            x = x + delta if delta is not None else x
        _, x = self._add_norm(x[logits_indices], None, self.norm)
        logits = linear(x, self.lm_head, None).float()
        if self._dispatch is not None:
            self._dispatch.step_done()
        return logits
