"""Per-token activation coefficients of the memory planner (bytes a decoder layer / vision block keeps for backward
per token or patch), eager attention's score tensors, and the sum over a decoder's layers. Read off the exact trace
(`vlmrl.plan.trace`) one dimension at a time and written as functions of the dimensions (docs/planner.md).
Pure arithmetic over a ModelSpec and a Workload."""

from __future__ import annotations

from vlmrl.plan.spec import ModelSpec, Workload


def text_layer_bytes(spec: ModelSpec, w: Workload, cbytes: int) -> float:
    """Bytes one decoder layer keeps for backward per token (no checkpointing).

    Full fine-tuning: two RMSNorms (fp32 copy + normalised input + output: 16h), q after RoPE, k and v
    repeated to the query heads, attention output and its contiguous copy (10 x heads*head_dim), the gated
    MLP's gate, up, act and product (8i), the float32 log-sum-exp per head (4 heads), less 2h the trace does
    not keep. LoRA (fp32 adapters): each adapted Linear keeps a float32 copy of its input (half that under
    autocast, which casts it back to bf16) plus r floats, while the frozen norms and base Linears stop
    keeping 6h + 2*heads*head_dim + 2i."""
    h, i, qd = spec.hidden, spec.intermediate, spec.heads * spec.head_dim
    s = cbytes / 2
    extra_norms = spec.norms_per_layer - 2
    full = s * (14 * h + 8 * h * extra_norms + 10 * qd + 8 * i) + 4 * spec.heads
    if spec.gated_attention:
        # Qwen3.5's full-attention layer (read off the trace one dimension at a time): its (1 + weight) float32 norms keep
        # 20h, q_proj's doubled output (query + gate), the q/k norms, the gate's sigmoid and product 20 qd, k and v 8 per
        # KV dimension (the fused kernels read them grouped), the MLP 8i.
        full = s * (20 * h + 20 * qd + 8 * spec.kv_heads * spec.head_dim + 8 * i) + 4 * spec.heads
    in_dims = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": qd, "gate_proj": h, "up_proj": h, "down_proj": i}
    # Under LoRA Qwen3.5's frozen float32 norms drop 12h (the weight's share) and the gated attention 8 qd.
    frozen = 12 * h + 8 * qd + 2 * i if spec.gated_attention else 6 * h + 3 * h * extra_norms + 2 * qd + 2 * i
    return full + _lora_layer_delta(spec, w, cbytes, in_dims, frozen)


def _lora_layer_delta(spec: ModelSpec, w: Workload, cbytes: int, in_dims: dict, frozen: float) -> float:
    """LoRA's change to a decoder layer's bytes per token: each adapted Linear keeps a float32 copy of its input (half
    that under autocast) plus r floats, while the frozen norms and base Linears stop keeping `frozen` (in c/2 units)."""
    if not w.use_lora:
        return 0.0
    copy = 2 if w.autocast else 4
    all_linear = "all-linear" in w.lora_targets
    adapted = [d for n, d in in_dims.items() if all_linear or n in w.lora_targets]
    return copy * sum(adapted) + 4 * w.lora_r * len(adapted) - cbytes / 2 * frozen


LINEAR_ATTN_CHUNK = 64  # transformers' chunked gated delta rule: tokens per chunk (each row padded to a multiple)


def linear_layer_bytes(spec: ModelSpec, w: Workload, cbytes: int) -> tuple[float, float]:
    """Bytes a Gated DeltaNet (linear-attention) decoder layer of Qwen3.5 keeps for backward: (per token, per token of
    each row padded to a multiple of LINEAR_ATTN_CHUNK), read off the trace one dimension at a time.

    Per token: the norms and the MLP (20h + 8i in c/2 units, as the full-attention layer), the causal conv's input and
    output (2c per q, k, v channel), the gated RMSNorm of the output ((12 + 3c) per value dimension: float32 input, gate
    and its SiLU, cast products), beta and the decay (36 bytes per value head). Per padded token, in float32, per value
    head (query and key heads are repeated to the value heads): q, k before and after the L2 norm, scaling and decay,
    k x beta and the solved k (8 dk); v, the solved values and each chunk's corrected values (3 dv); five chunk x chunk
    matrices (the decay mask, the UT system, the intra-chunk attention and their factors: 5 x 64); and the recurrent
    state each chunk writes ([dk, dv] per chunk: dk dv / 64 per token)."""
    h, i = spec.hidden, spec.intermediate
    k_dim, v_dim = spec.linear_k_heads * spec.linear_k_dim, spec.linear_v_heads * spec.linear_v_dim
    dk, dv = spec.linear_k_dim, spec.linear_v_dim
    per_token = cbytes / 2 * (20 * h + 8 * i) + 2 * cbytes * (2 * k_dim + v_dim) + (12 + 3 * cbytes) * v_dim + 36 * spec.linear_v_heads
    per_padded = 4 * spec.linear_v_heads * (8 * dk + 3 * dv + 5 * LINEAR_ATTN_CHUNK + dk * dv / LINEAR_ATTN_CHUNK)
    in_dims = {"in_proj_qkv": h, "in_proj_z": h, "in_proj_a": h, "in_proj_b": h, "out_proj": v_dim, "gate_proj": h, "up_proj": h, "down_proj": i}
    return per_token + _lora_layer_delta(spec, w, cbytes, in_dims, 12 * h + 2 * v_dim + 2 * i), per_padded


def first_linear_layer_bytes(spec: ModelSpec, w: Workload, cbytes: int) -> float | None:
    """LoRA without adapters in the Gated DeltaNet mixer (the default targets): layer 0's input needs no gradient, so
    when it is a linear-attention layer its mixer and norms keep nothing; its MLP keeps its gated activations (8i) and
    its adapters' inputs. None when this does not apply (layer 0 keeps what every linear-attention layer keeps)."""
    mixer = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
    if not (w.use_lora and spec.first_layer_linear) or "all-linear" in w.lora_targets or any(m in w.lora_targets for m in mixer):
        return None
    h, i = spec.hidden, spec.intermediate
    return cbytes / 2 * 8 * i + _lora_layer_delta(spec, w, cbytes, {"gate_proj": h, "up_proj": h, "down_proj": i}, 0)


def linear_state_bytes(spec: ModelSpec, cbytes: int) -> float:
    """One row's Gated DeltaNet cache over all linear-attention layers: the causal conv's last columns (compute dtype)
    and the float32 recurrent state [v_heads, dk, dv] (no sequence axis: the same for any length)."""
    conv = (2 * spec.linear_k_heads * spec.linear_k_dim + spec.linear_v_heads * spec.linear_v_dim) * spec.linear_conv_kernel * cbytes
    return spec.linear_attn_layers * (conv + 4 * spec.linear_v_heads * spec.linear_k_dim * spec.linear_v_dim)


def vision_block_bytes(spec: ModelSpec, cbytes: int) -> float:
    """Bytes one vision block keeps per patch (trainable tower, no checkpointing): fused qkv kept whole,
    RoPE'd q/k, attention output + copy, two norms (30 hv), the MLP (gated: 8 iv; Qwen2-VL's fc1 -> quick_gelu -> fc2:
    4 iv, read off the trace of qwen2-vl-2b), fp32 lse per head."""
    s = cbytes / 2
    mlp = 8 if spec.v_mlp_gated else 4
    return s * (spec.v_block_hidden * spec.v_hidden + mlp * spec.v_intermediate) + 4 * spec.v_heads


def eager_attention_bytes(spec: ModelSpec, w: Workload, cb: int, rows: tuple, vis_images: int, patches_per_image: int) -> dict:
    """Eager attention's score tensors (model.attn_implementation=eager), bytes.

    transformers' eager_attention_forward (Qwen2-VL / Qwen2.5-VL text and vision) computes scores = q k^T in the
    compute dtype, softmax(scores, dtype=float32) and casts the probabilities back: backward keeps the float32
    softmax output and the cast probabilities, (4 + c) bytes per [heads, query, key] element, per layer call. The
    fused kernels (sdpa, flash) keep a float32 log-sum-exp per head and query instead (in text_layer_bytes /
    vision_block_bytes), so that is taken off. rows: ((rows, queries, keys), ...) of one decoder layer's attention
    calls (prompt pass and completion pass on the shared-prefix path). Returns text / vision bytes kept for
    backward over all layers, one layer's worth (what checkpointing recomputes), and the no-grad transient of one
    layer call (scores in c, float32 softmax, cast probabilities)."""
    if w.attn_implementation != "eager":
        return {"text": 0, "vision": 0, "text_layer": 0, "vision_block": 0, "transient": 0}
    per = 4 + cb
    pairs = sum(r * q * k for r, q, k in rows)
    queries = sum(r * q for r, q, k in rows)
    text_layer = spec.heads * (pairs * per - 4 * queries)
    vision_block = 0.0
    if spec.v_layers and patches_per_image:
        full = spec.v_layers if spec.v_full_attn_blocks < 0 else spec.v_full_attn_blocks
        window = min(spec.v_window_patches or patches_per_image, patches_per_image)
        elems = full * patches_per_image**2 + (spec.v_layers - full) * patches_per_image * window
        vision_block = spec.v_heads * vis_images * (elems * per - 4 * spec.v_layers * patches_per_image) / spec.v_layers
    return {
        "text": (spec.layers - spec.linear_attn_layers) * text_layer,  # Qwen3.5's linear-attention layers have no scores
        "vision": spec.v_layers * vision_block,
        "text_layer": text_layer,
        "vision_block": vision_block,
        "transient": spec.heads * max(r * q * k for r, q, k in rows) * (2 * cb + 4),
    }


class DecoderBytes:
    """Activation bytes over the decoder's layers: full-attention layers per token, Qwen3.5's linear-attention layers
    per token plus per token of each row padded to a multiple of LINEAR_ATTN_CHUNK. segments: ((rows, length), ...)."""

    def __init__(self, spec: ModelSpec, lin_pad: float, segments: tuple, first: float | None = None):
        self.linear = spec.linear_attn_layers
        self.full_layers = spec.layers - self.linear
        self.lin_pad = lin_pad
        self.segments = segments
        self.first = first  # bytes per token of layer 0 when it keeps less than the others (first_linear_layer_bytes)

    def padded(self, segments: tuple | None = None) -> int:
        return sum(r * -(-max(n, 0) // LINEAR_ATTN_CHUNK) * LINEAR_ATTN_CHUNK for r, n in segments or self.segments)

    def layer(self, lin_tok: float, tokens: float, segments: tuple | None = None) -> float:
        """One linear-attention layer."""
        return tokens * lin_tok + self.padded(segments) * self.lin_pad

    def all_layers(self, per_full: float, lin_tok: float, tokens: float, segments: tuple | None = None) -> float:
        if not self.linear:
            return self.full_layers * tokens * per_full
        if self.first is None:
            return self.full_layers * tokens * per_full + self.linear * self.layer(lin_tok, tokens, segments)
        return self.full_layers * tokens * per_full + (self.linear - 1) * self.layer(lin_tok, tokens, segments) + self.first * tokens
