#!/usr/bin/python3
"""PyTorch reference for tessel's model layer (nn/): tiny decoder LMs with Hugging Face's semantics
and tensor names, written as HF checkpoints plus the numbers a port must reproduce.

Usage: reference_models.py OUTDIR [--models llama,mistral,...] [--check]

Per model, OUTDIR/<name>/ gets config.json, model.safetensors (F32, HF names), inputs.safetensors
and reference.safetensors; llama also gets OUTDIR/llama_sharded/ (two shards and
model.safetensors.index.json). The contract (names, shapes, conventions) is tools/torch/README.md.
Plain torch (1.13, Debian's python3-torch): the models and the safetensors reader and writer are
written here, without transformers or safetensors. Deterministic: the same torch build writes the
same bytes on every run. --check reloads every file with this script's own reader and recomputes
every model with a second, loop-based implementation written independently of the vectorized one.
"""
import argparse
import copy
import json
import math
import re
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import torch_threads  # the script's own directory is on sys.path

SEED = 17_2024
BATCH, SEQ = 2, 12
IGNORE = -100
STEPS = 20
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
# Linears, embeddings and biases: N(0, INIT_STD^2). HF initializes with 0.02; 0.05 keeps the
# activations large enough that GPT-2's GELU tanh-vs-erf mistake moves the logits by ~380x the f32
# rounding spread (55x at 0.02, i.e. ~1e-5: under a tolerance a port might pick); see --check.
INIT_STD = 0.05
NORM_JITTER = 0.1        # norm weights are 1 + NORM_JITTER * N(0, 1)
ROUTER_STD = 0.3         # Mixtral's router: decisive top-k choices (see --check's margins)
GENERATOR = "tools/torch/reference_models.py"

# ---- configs (Hugging Face config.json as transformers writes it for each family) -------------

def _rotary_base(**over):
    c = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": INIT_STD,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": 97,
    }
    c.update(over)
    return dict(sorted(c.items()))


def _strip(c, *keys):
    for k in keys:
        c.pop(k, None)
    return c


CONFIGS = {
    # Llama 2/3 layout: GQA (4 heads, 2 kv heads), untied lm_head, no biases.
    "llama": _rotary_base(),
    # Llama with attention_bias (q, k, v and o) and mlp_bias (gate, up, down).
    "llama_bias": _rotary_base(attention_bias=True, mlp_bias=True),
    # Llama 3.1's rope scaling; with head_dim 16 and theta 5e5 the 8 frequencies fall in all three
    # bands (wavelength < 16 kept, 16..64 interpolated, > 64 divided by the factor).
    "llama3_rope": _rotary_base(rope_theta=500000.0, max_position_embeddings=512,
                                rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64, "rope_type": "llama3"}),
    # Mistral: a sliding window shorter than the sequence, and head_dim 32 != hidden/heads (as
    # Mistral-Nemo), so q_proj is (128, 64) and o_proj (64, 128); a multiple of 16, as tessel's attention needs.
    "mistral": dict(sorted(_strip(_rotary_base(architectures=["MistralForCausalLM"], model_type="mistral",
                                               head_dim=32, sliding_window=5),
                                  "attention_bias", "mlp_bias", "pretraining_tp", "rope_scaling").items())),
    # Qwen2 (0.5B layout): q/k/v bias, no o bias, tied embeddings, no sliding window.
    "qwen2": dict(sorted(_strip(_rotary_base(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                             rms_norm_eps=1e-06, rope_theta=1000000.0, tie_word_embeddings=True,
                                             use_sliding_window=False, sliding_window=128, max_window_layers=2),
                                "attention_bias", "mlp_bias", "pretraining_tp", "rope_scaling").items())),
    # Mixtral: 4 experts (intermediate 96 each), top-2, aux coefficient as Mixtral-8x7B's.
    "mixtral": dict(sorted(_strip(_rotary_base(architectures=["MixtralForCausalLM"], model_type="mixtral",
                                               num_local_experts=4, num_experts_per_tok=2, output_router_logits=False,
                                               router_aux_loss_coef=0.02, router_jitter_noise=0.0,
                                               rope_theta=1000000.0, sliding_window=None),
                                  "attention_bias", "mlp_bias", "pretraining_tp", "rope_scaling").items())),
    # GPT-2: learned positions, LayerNorm, Conv1D (weights stored (in, out)), gelu_new, tied lm_head;
    # n_inner null means 4 * n_embd.
    "gpt2": {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.0,
        "bos_token_id": 96,
        "embd_pdrop": 0.0,
        "eos_token_id": 96,
        "initializer_range": INIT_STD,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 32,
        "n_embd": 64,
        "n_head": 4,
        "n_inner": None,
        "n_layer": 2,
        "n_positions": 32,
        "resid_pdrop": 0.0,
        "scale_attn_weights": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": 97,
    },
}
MODEL_NAMES = list(CONFIGS)
SHARDED = {"llama"}
MODEL_SEED = {name: SEED + 1000 * (i + 1) for i, name in enumerate(MODEL_NAMES)}  # order-independent


class Dims:
    """The sizes of a config, read the way transformers reads them (only the fields written above)."""

    def __init__(self, c):
        self.family = c["model_type"]
        self.gpt2 = self.family == "gpt2"
        if self.gpt2:
            self.hidden, self.layers, self.heads = c["n_embd"], c["n_layer"], c["n_head"]
            self.kv_heads, self.head_dim = self.heads, self.hidden // self.heads
            self.inter = c["n_inner"] or 4 * self.hidden
            self.eps = c["layer_norm_epsilon"]
            self.positions = c["n_positions"]
            self.tied = c.get("tie_word_embeddings", True)
            self.window = None
            self.theta, self.rope_scaling = 0.0, None
        else:
            self.hidden, self.layers = c["hidden_size"], c["num_hidden_layers"]
            self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
            self.head_dim = c.get("head_dim") or self.hidden // self.heads
            self.inter = c["intermediate_size"]
            self.eps = c["rms_norm_eps"]
            self.theta = c["rope_theta"]
            self.rope_scaling = c.get("rope_scaling")
            self.tied = c.get("tie_word_embeddings", False)
            self.window = c.get("sliding_window") if self.family in ("mistral", "mixtral") else None
            if self.family == "qwen2" and c.get("use_sliding_window"):
                raise ValueError("Qwen2's use_sliding_window is not modelled here")
        self.vocab = c["vocab_size"]
        self.qkv_bias = self.gpt2 or self.family == "qwen2" or bool(c.get("attention_bias"))
        self.o_bias = self.gpt2 or (self.family == "llama" and bool(c.get("attention_bias")))
        self.mlp_bias = self.gpt2 or (self.family == "llama" and bool(c.get("mlp_bias")))
        self.experts = c.get("num_local_experts", 0) if self.family == "mixtral" else 0
        self.top_k = c.get("num_experts_per_tok", 0)
        self.aux_coef = c.get("router_aux_loss_coef", 0.0)


# ---- rotary frequencies -----------------------------------------------------------------------

def inv_freq(d: Dims):
    """theta^(-2i/head_dim), i < head_dim/2, in float64, with Llama 3.1's scaling when configured."""
    half = d.head_dim // 2
    f = torch.tensor([d.theta ** (-2.0 * i / d.head_dim) for i in range(half)], dtype=torch.float64)
    rs = d.rope_scaling
    if rs is None:
        return f
    if rs.get("rope_type", rs.get("type")) != "llama3":
        raise ValueError("only llama3 rope scaling is modelled")
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / f
    smooth = (old / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * f / factor + smooth * f
    out = torch.where(wavelen > old / low, f / factor, f)              # long wavelengths: divided
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, interpolated, out)


def rope_tables(d: Dims, seq, dtype):
    """cos and sin of position * inv_freq, (seq, head_dim) with the half repeated (rotate_half layout);
    computed in float64 and rounded once to dtype."""
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq(d)[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def allowed_keys(seq, window):
    """(seq, seq) bool: query i sees key j when j <= i and, with a window W, i - W < j."""
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (j > i - window)
    return ok


# ---- the models (module tree = HF's, so named_parameters() are HF's names) ---------------------

class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Conv1D(nn.Module):
    """GPT-2's projection: y = x @ W + b with W stored (in, out)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


def attend(q, k, v, mask):
    """q (B,H,S,D), k and v (B,KV,S,D): grouped heads, kv head h // (H/KV) serves query head h."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


class Attention(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        self.q_proj = nn.Linear(d.hidden, q, bias=d.qkv_bias)
        self.k_proj = nn.Linear(d.hidden, kv, bias=d.qkv_bias)
        self.v_proj = nn.Linear(d.hidden, kv, bias=d.qkv_bias)
        self.o_proj = nn.Linear(q, d.hidden, bias=d.o_bias)

    def forward(self, x, cos, sin, mask):
        d, (b, s, _) = self.d, x.shape
        q = self.q_proj(x).view(b, s, d.heads, d.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, d.kv_heads, d.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, d.kv_heads, d.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = attend(q, k, v, mask).transpose(1, 2).reshape(b, s, d.heads * d.head_dim)
        return self.o_proj(o)


class SwiGLU(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden, d.inter, bias=d.mlp_bias)
        self.up_proj = nn.Linear(d.hidden, d.inter, bias=d.mlp_bias)
        self.down_proj = nn.Linear(d.inter, d.hidden, bias=d.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.w1 = nn.Linear(d.hidden, d.inter, bias=False)  # gate
        self.w3 = nn.Linear(d.hidden, d.inter, bias=False)  # up
        self.w2 = nn.Linear(d.inter, d.hidden, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoe(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        self.gate = nn.Linear(d.hidden, d.experts, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(d.experts))

    def forward(self, x):
        b, s, c = x.shape
        x = x.reshape(b * s, c)
        logits = self.gate(x)                                   # (B*S, E)
        probs = torch.softmax(logits, dim=-1)
        w, idx = torch.topk(probs, self.d.top_k, dim=-1)        # (B*S, k), descending
        w = w / w.sum(dim=-1, keepdim=True)                     # renormalized over the chosen k
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel():
                out = out.index_add(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out.view(b, s, c), logits


class RotaryLayer(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.self_attn = Attention(d)
        if d.experts:
            self.block_sparse_moe = SparseMoe(d)
        else:
            self.mlp = SwiGLU(d)
        self.input_layernorm = RMSNorm(d.hidden, d.eps)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.eps)

    def forward(self, h, cos, sin, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask)
        x = self.post_attention_layernorm(h)
        if hasattr(self, "block_sparse_moe"):
            y, router = self.block_sparse_moe(x)
            return h + y, router
        return h + self.mlp(x), None


class RotaryLM(nn.Module):
    """Llama, Mistral, Qwen2, Mixtral: model.{embed_tokens,layers,norm}, lm_head."""

    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(d.vocab, d.hidden)
        self.model.layers = nn.ModuleList(RotaryLayer(d) for _ in range(d.layers))
        self.model.norm = RMSNorm(d.hidden, d.eps)
        if not d.tied:
            self.lm_head = nn.Linear(d.hidden, d.vocab, bias=False)

    def forward(self, ids):
        s = ids.shape[1]
        h = self.model.embed_tokens(ids)
        cos, sin = rope_tables(self.d, s, h.dtype)
        mask = allowed_keys(s, self.d.window)
        routers = []
        for layer in self.model.layers:
            h, r = layer(h, cos, sin, mask)
            if r is not None:
                routers.append(r)
        h = self.model.norm(h)
        w = self.model.embed_tokens.weight if self.d.tied else self.lm_head.weight
        return h @ w.t(), routers


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class GPT2Block(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        self.ln_1 = nn.LayerNorm(d.hidden, eps=d.eps)
        self.attn = nn.Module()
        self.attn.c_attn = Conv1D(d.hidden, 3 * d.hidden)
        self.attn.c_proj = Conv1D(d.hidden, d.hidden)
        self.ln_2 = nn.LayerNorm(d.hidden, eps=d.eps)
        self.mlp = nn.Module()
        self.mlp.c_fc = Conv1D(d.hidden, d.inter)
        self.mlp.c_proj = Conv1D(d.inter, d.hidden)

    def forward(self, h, mask):
        d, (b, s, c) = self.d, h.shape
        q, k, v = self.attn.c_attn(self.ln_1(h)).split(c, dim=-1)
        heads = lambda t: t.view(b, s, d.heads, d.head_dim).transpose(1, 2)  # noqa: E731
        o = attend(heads(q), heads(k), heads(v), mask).transpose(1, 2).reshape(b, s, c)
        h = h + self.attn.c_proj(o)
        return h + self.mlp.c_proj(gelu_new(self.mlp.c_fc(self.ln_2(h))))


class GPT2LM(nn.Module):
    """transformer.{wte,wpe,h,ln_f}; lm_head is wte (tied, not stored)."""

    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(d.vocab, d.hidden)
        self.transformer.wpe = nn.Embedding(d.positions, d.hidden)
        self.transformer.h = nn.ModuleList(GPT2Block(d) for _ in range(d.layers))
        self.transformer.ln_f = nn.LayerNorm(d.hidden, eps=d.eps)

    def forward(self, ids):
        s = ids.shape[1]
        t = self.transformer
        h = t.wte(ids) + t.wpe(torch.arange(s))[None]
        mask = allowed_keys(s, None)
        for block in t.h:
            h = block(h, mask)
        return t.ln_f(h) @ t.wte.weight.t(), []


def build(name):
    d = Dims(CONFIGS[name])
    m = GPT2LM(d) if d.gpt2 else RotaryLM(d)
    g = torch.Generator().manual_seed(MODEL_SEED[name])
    with torch.no_grad():
        for pname, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in pname or ".ln_" in pname:
                p.copy_(1 + NORM_JITTER * r if pname.endswith("weight") else INIT_STD * r)
            elif pname.endswith("block_sparse_moe.gate.weight"):
                p.copy_(ROUTER_STD * r)
            else:
                p.copy_(INIT_STD * r)
    return m, d


# ---- losses -----------------------------------------------------------------------------------

def hf_loss(logits, labels):
    """transformers' causal-LM loss: logits at t predict labels at t+1; mean over labels != -100."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), ignore_index=IGNORE)


def aux_loss(router_logits, d: Dims):
    """transformers' load_balancing_loss_func without an attention mask, over all layers' tokens:
    E * sum_e f_e * P_e, f_e = (tokens with e among their top-k) / N, P_e = mean softmax prob of e;
    N = layers * batch * seq. No division by k; the top-k mask carries no gradient."""
    logits = torch.cat(router_logits, dim=0)
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, d.top_k, dim=-1).indices
    mask = F.one_hot(chosen, d.experts).to(probs.dtype)        # (N, k, E)
    return d.experts * torch.sum(mask.mean(dim=0) * probs.mean(dim=0)[None])


def make_inputs():
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, CONFIGS["llama"]["vocab_size"], (BATCH, SEQ), generator=g, dtype=torch.int64)
    labels = ids.clone()
    for b, t in ((0, 0), (0, 5), (1, 8), (1, 9)):  # (0, 0) is never a target (the shift drops it)
        labels[b, t] = IGNORE
    targets = torch.full_like(labels, IGNORE)
    targets[:, :-1] = labels[:, 1:]
    return ids, labels, targets


# ---- safetensors (own reader and writer) -----------------------------------------------------

ST = {torch.float32: ("F32", np.float32), torch.float64: ("F64", np.float64), torch.int64: ("I64", np.int64)}
ST_NP = {name: npt for name, npt in ST.values()}


def atomic_write(path, data: bytes):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def st_bytes(tensors, metadata):
    """safetensors file: u64 LE header length, JSON header padded with spaces to 8 bytes, data.
    Tensors ordered by element size (largest first), then name: each one aligned for its type."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header, blobs, at = {}, [], 0
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in sorted(metadata.items())}
    for n in order:
        t = tensors[n].detach().contiguous()
        tag, npt = ST[t.dtype]
        raw = t.numpy().astype(np.dtype(npt).newbyteorder("<"), copy=False).tobytes()
        header[n] = {"dtype": tag, "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h + b"".join(blobs)


def st_write(path, tensors, metadata=None):
    atomic_write(path, st_bytes(tensors, metadata))


def st_read(path):
    """(tensors, metadata); checks the rules tessel's reader checks."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: shorter than 8 bytes")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        raise ValueError(f"{path}: header runs past the end")
    header = json.loads(raw[8:8 + n].decode())
    data = raw[8 + n:]
    meta = header.pop("__metadata__", {})
    spans, out = [], {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        npt = ST_NP[e["dtype"]]
        count = int(np.prod(e["shape"], dtype=np.int64))
        if b - a != count * np.dtype(npt).itemsize:
            raise ValueError(f"{path}: {name}: {b - a} bytes for shape {e['shape']}")
        spans.append((a, b))
        arr = np.frombuffer(data[a:b], dtype=np.dtype(npt).newbyteorder("<")).reshape(e["shape"])
        out[name] = torch.from_numpy(arr.astype(npt))
    at = 0
    for a, b in sorted(spans):
        if a != at:
            raise ValueError(f"{path}: gap or overlap at {a}")
        at = b
    if at != len(data):
        raise ValueError(f"{path}: {len(data) - at} trailing bytes")
    return out, meta


def write_sharded(dirpath, tensors, order, metadata):
    """HF's layout: shards filled in parameter order, cut where the first half of the bytes ends."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    first, acc = [], 0
    for n in order:
        if acc >= total / 2:
            break
        first.append(n)
        acc += tensors[n].numel() * tensors[n].element_size()
    groups = [first, [n for n in order if n not in set(first)]]
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for names, fname in zip(groups, files):
        st_write(os.path.join(dirpath, fname), {n: tensors[n] for n in names}, metadata)
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write(os.path.join(dirpath, "model.safetensors.index.json"), (json.dumps(index, indent=2) + "\n").encode())
    return files


# ---- the reference numbers --------------------------------------------------------------------

def param_dict(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def topk_margin(routers, k):
    """Smallest gap between the k-th and (k+1)-th router probability over the tokens."""
    m = math.inf
    for r in routers:
        p = torch.softmax(r.detach(), dim=-1).sort(dim=-1, descending=True).values
        m = min(m, (p[:, k - 1] - p[:, k]).min().item())
    return m


def train(template, dtype, ids, labels, d: Dims):
    """STEPS AdamW steps on the CE loss at one batch; returns params, losses, per-step routing, margin."""
    m = copy.deepcopy(template).to(dtype)
    opt = torch.optim.AdamW(m.parameters(), lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"], foreach=False)
    losses, routes, margin = [], [], math.inf
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        logits, routers = m(ids)
        loss = hf_loss(logits, labels)
        losses.append(loss.item())
        if routers:
            margin = min(margin, topk_margin(routers, d.top_k))
        routes.append([torch.topk(r.detach(), d.top_k, dim=-1).indices for r in routers])
        loss.backward()
        opt.step()
    return param_dict(m), losses, routes, margin


def reference(name, out_root, inputs):
    t0 = time.time()
    cfg = CONFIGS[name]
    m32, d = build(name)
    ids, labels, targets = inputs
    params = param_dict(m32)
    order = list(params)

    m64 = copy.deepcopy(m32).double()
    p64 = dict(m64.named_parameters())
    logits, routers = m64(ids)
    loss = hf_loss(logits, labels)
    grads = torch.autograd.grad(loss, list(p64.values()), retain_graph=True, allow_unused=True)
    ref = {"logits": logits.detach(), "loss": loss.detach().reshape(1)}
    for n, g in zip(p64, grads):
        ref["grad." + n] = g if g is not None else torch.zeros_like(p64[n])
    aux = None
    if d.experts:
        aux = aux_loss(routers, d)
        total = loss + d.aux_coef * aux
        gt = torch.autograd.grad(total, list(p64.values()), allow_unused=True)
        for n, g in zip(p64, gt):
            ref["grad_total." + n] = g if g is not None else torch.zeros_like(p64[n])
        ref["aux_loss"] = aux.detach().reshape(1)
        for i, r in enumerate(routers):
            ref[f"router_logits.{i}"] = r.detach()

    after32, losses32, routes32, margin32 = train(m32, torch.float32, ids, labels, d)
    after64, losses64, routes64, margin64 = train(m32, torch.float64, ids, labels, d)
    if d.experts and any(not torch.equal(a, b) for s32, s64 in zip(routes32, routes64) for a, b in zip(s32, s64)):
        raise RuntimeError(f"{name}: the f32 and f64 AdamW runs route tokens differently; the spread would be meaningless")
    for n in order:
        ref["adamw20." + n] = after32[n]
        ref["adamw20_f64." + n] = after64[n]
    ref["losses20"] = torch.tensor(losses32, dtype=torch.float64)
    ref["losses20_f64"] = torch.tensor(losses64, dtype=torch.float64)
    ref64, ref = ref, {k: v.to(torch.float32) for k, v in ref.items()}

    meta = {"format": "pt", "generator": GENERATOR, "torch_version": torch.__version__, "model": name,
            "seed": str(MODEL_SEED[name]), "input_seed": str(SEED)}
    ref_meta = dict(meta)
    ref_meta.update({
        "compute": "float64 from the F32 parameters; stored as F32",
        "loss": "mean cross-entropy of logits[:, :-1] against labels[:, 1:], labels == -100 ignored",
        "adamw": json.dumps({**ADAMW, "betas": list(ADAMW["betas"]), "steps": STEPS, "foreach": False,
                             "loss": "cross-entropy only", "dtypes": "adamw20/losses20: float32, *_f64: float64"}),
        "init": json.dumps({"std": INIT_STD, "norm_weight": f"1 + {NORM_JITTER} * N(0,1)", "router_std": ROUTER_STD}),
        "batch": str(BATCH), "seq": str(SEQ),
    })
    if d.experts:
        ref_meta["router_aux_loss_coef"] = repr(d.aux_coef)
        ref_meta["topk_margin"] = repr(topk_margin(routers, d.top_k))
        ref_meta["min_topk_margin_adamw20"] = repr(min(margin32, margin64))
    ref_meta["f32_vs_f64_final_loss"] = repr(abs(losses32[-1] - losses64[-1]))

    outdir = os.path.join(out_root, name)
    os.makedirs(outdir, exist_ok=True)
    atomic_write(os.path.join(outdir, "config.json"), (json.dumps(cfg, indent=2) + "\n").encode())
    st_write(os.path.join(outdir, "model.safetensors"), params, {"format": "pt"})
    inp = {"input_ids": ids, "labels": labels, "targets": targets}
    st_write(os.path.join(outdir, "inputs.safetensors"), inp, meta)
    st_write(os.path.join(outdir, "reference.safetensors"), ref, ref_meta)
    written = {"model.safetensors": (params, {"format": "pt"}), "inputs.safetensors": (inp, meta),
               "reference.safetensors": (ref, ref_meta)}
    shards = None
    if name in SHARDED:
        sdir = os.path.join(out_root, name + "_sharded")
        os.makedirs(sdir, exist_ok=True)
        atomic_write(os.path.join(sdir, "config.json"), (json.dumps(cfg, indent=2) + "\n").encode())
        shards = write_sharded(sdir, params, order, {"format": "pt"})
    numel = sum(p.numel() for p in params.values())
    extra = (f", aux {aux.item():.5f}, top-k margin {topk_margin(routers, d.top_k):.1e} "
             f"(over the AdamW steps {min(margin32, margin64):.1e})") if d.experts else ""
    print(f"{name}: {numel} params, loss {loss.item():.6f}, after {STEPS} AdamW steps {losses32[-1]:.6f} "
          f"(f32 vs f64 {abs(losses32[-1] - losses64[-1]):.1e}){extra}{', sharded copy' if shards else ''}, "
          f"{time.time() - t0:.2f} s -> {outdir}")
    return {"model": m32, "m64": m64, "dims": d, "logits": logits.detach(), "loss": loss.detach(),
            "aux": None if aux is None else aux.detach(), "grads": ref64, "written": written, "shards": shards,
            "after64": after64}


# ---- --check: round trip, and a second implementation -----------------------------------------

class CheckFailed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise CheckFailed(what)


def naive_logits(P, d: Dims, ids, *, bug=None):
    """An independent, loop-based forward from the flat HF-named tensors (float64). `bug` injects one
    plausible porting mistake, to measure that the reference tells it apart."""
    B, S = ids.shape
    C, H, KV, D = d.hidden, d.heads, d.kv_heads, d.head_dim

    def rms(x, w):
        return w * x / math.sqrt(float((x * x).sum()) / x.numel() + d.eps)

    def layer_norm(x, w, b):
        mu = float(x.sum()) / x.numel()
        var = float(((x - mu) ** 2).sum()) / x.numel()
        return (x - mu) / math.sqrt(var + d.eps) * w + b

    def lin(x, p, bias):  # nn.Linear: weight (out, in)
        y = P[p + ".weight"] @ x
        return y + P[p + ".bias"] if bias else y

    def conv(x, p):  # GPT-2 Conv1D: weight (in, out)
        w = P[p + ".weight"]
        if bug == "c_proj_as_linear" and p.endswith("attn.c_proj"):
            w = w.t()  # square, so a port that reads it as nn.Linear's (out, in) would not notice
        return x @ w + P[p + ".bias"]

    freqs = []
    if not d.gpt2:
        for i in range(D // 2):
            f = d.theta ** (-2.0 * i / D)
            rs = d.rope_scaling
            if rs is not None and bug != "no_rope_scaling":
                lam = 2 * math.pi / f
                lo, hi, old = rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
                if lam < old / hi:
                    pass
                elif lam > old / lo:
                    f = f / rs["factor"]
                else:
                    t = (old / lam - lo) / (hi - lo)
                    f = (1 - t) * f / rs["factor"] + t * f
            freqs.append(f)

    def rope(x, pos):  # x (D,): rotate the pairs (k, k + D/2) by pos * freq_k
        y = x.clone()
        for k, f in enumerate(freqs):
            a, b = (2 * k, 2 * k + 1) if bug == "interleaved_rope" else (k, k + D // 2)
            c, s = math.cos(pos * f), math.sin(pos * f)
            y[a] = x[a] * c - x[b] * s
            y[b] = x[b] * c + x[a] * s
        return y

    def visible(i, j):
        if j > i:
            return False
        if d.window is not None:
            return j >= i - d.window if bug == "window_off_by_one" else j > i - d.window
        return True

    def attention(qs, ks, vs):  # lists over positions of (H*D,), (KV*D,), (KV*D,)
        out = [torch.zeros(H * D, dtype=torch.float64) for _ in range(S)]
        for h in range(H):
            g = h % KV if bug == "gqa_modulo" else h // (H // KV)
            for i in range(S):
                qi = qs[i][h * D:(h + 1) * D]
                js = [j for j in range(S) if visible(i, j)]
                sc = [float(qi @ ks[j][g * D:(g + 1) * D]) / math.sqrt(D) for j in js]
                mx = max(sc)
                e = [math.exp(v - mx) for v in sc]
                z = sum(e)
                for j, ej in zip(js, e):
                    out[i][h * D:(h + 1) * D] += (ej / z) * vs[j][g * D:(g + 1) * D]
        return out

    def silu(x):
        if bug == "gelu_for_silu":
            return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
        return x / (1 + torch.exp(-x))

    def gelu(x):
        if bug == "gelu_erf":
            return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    def moe(x, p):
        logit = P[p + ".gate.weight"] @ x
        mx = float(logit.max())
        pr = [math.exp(float(v) - mx) for v in logit]
        z = sum(pr)
        pr = [v / z for v in pr]
        top = sorted(range(d.experts), key=lambda e: -pr[e])[:d.top_k]
        wsum = 1.0 if bug == "moe_no_renorm" else sum(pr[e] for e in top)
        y = torch.zeros(C, dtype=torch.float64)
        for e in top:
            q = f"{p}.experts.{e}"
            y += (pr[e] / wsum) * (P[q + ".w2.weight"] @ (silu(P[q + ".w1.weight"] @ x) * (P[q + ".w3.weight"] @ x)))
        return y, logit

    all_logits, routers = torch.zeros(B, S, d.vocab, dtype=torch.float64), [[] for _ in range(d.layers)]
    for b in range(B):
        if d.gpt2:
            T = "transformer"
            hs = [P[f"{T}.wte.weight"][ids[b, t]] + P[f"{T}.wpe.weight"][t] for t in range(S)]
            for li in range(d.layers):
                p = f"{T}.h.{li}"
                a = [layer_norm(x, P[p + ".ln_1.weight"], P[p + ".ln_1.bias"]) for x in hs]
                qkv = [conv(x, p + ".attn.c_attn") for x in a]
                o = attention([t[:C] for t in qkv], [t[C:2 * C] for t in qkv], [t[2 * C:] for t in qkv])
                hs = [x + conv(y, p + ".attn.c_proj") for x, y in zip(hs, o)]
                m = [layer_norm(x, P[p + ".ln_2.weight"], P[p + ".ln_2.bias"]) for x in hs]
                hs = [x + conv(gelu(conv(y, p + ".mlp.c_fc")), p + ".mlp.c_proj") for x, y in zip(hs, m)]
            final = [layer_norm(x, P[f"{T}.ln_f.weight"], P[f"{T}.ln_f.bias"]) for x in hs]
            head = P[f"{T}.wte.weight"]
        else:
            hs = [P["model.embed_tokens.weight"][ids[b, t]].clone() for t in range(S)]
            for li in range(d.layers):
                p = f"model.layers.{li}"
                a = [rms(x, P[p + ".input_layernorm.weight"]) for x in hs]
                qs = [lin(x, p + ".self_attn.q_proj", d.qkv_bias) for x in a]
                ks = [lin(x, p + ".self_attn.k_proj", d.qkv_bias) for x in a]
                vs = [lin(x, p + ".self_attn.v_proj", d.qkv_bias) for x in a]
                qs = [torch.cat([rope(q[h * D:(h + 1) * D], t) for h in range(H)]) for t, q in enumerate(qs)]
                ks = [torch.cat([rope(k[h * D:(h + 1) * D], t) for h in range(KV)]) for t, k in enumerate(ks)]
                o = attention(qs, ks, vs)
                hs = [x + lin(y, p + ".self_attn.o_proj", d.o_bias) for x, y in zip(hs, o)]
                m = [rms(x, P[p + ".post_attention_layernorm.weight"]) for x in hs]
                if d.experts:
                    ys = []
                    for x in m:
                        y, r = moe(x, p + ".block_sparse_moe")
                        ys.append(y)
                        routers[li].append(r)
                else:
                    mp = p + ".mlp"
                    ys = [lin(silu(lin(x, mp + ".gate_proj", d.mlp_bias)) * lin(x, mp + ".up_proj", d.mlp_bias),
                              mp + ".down_proj", d.mlp_bias) for x in m]
                hs = [x + y for x, y in zip(hs, ys)]
            final = [rms(x, P["model.norm.weight"]) for x in hs]
            head = P["model.embed_tokens.weight"] if d.tied else P["lm_head.weight"]
        for t in range(S):
            all_logits[b, t] = head @ final[t]
    return all_logits, [torch.stack(r) for r in routers] if d.experts else []


def naive_loss(logits, targets):
    """Mean of logsumexp(l) - l[target] over the already-shifted targets != -100."""
    total, count = 0.0, 0
    B, S, _ = logits.shape
    for b in range(B):
        for t in range(S):
            y = int(targets[b, t])
            if y == IGNORE:
                continue
            row = logits[b, t]
            mx = float(row.max())
            total += mx + math.log(float(torch.exp(row - mx).sum())) - float(row[y])
            count += 1
    return total / count


def naive_aux(routers, d: Dims):
    rows = torch.cat(routers)  # (N, E)
    n = rows.shape[0]
    probs = torch.softmax(rows, dim=-1)
    counts = [0] * d.experts
    for r in probs:
        for e in sorted(range(d.experts), key=lambda e: -float(r[e]))[:d.top_k]:
            counts[e] += 1
    return d.experts * sum(counts[e] / n * float(probs[:, e].mean()) for e in range(d.experts))


def manual_adamw(m64, ids, labels):
    """The update rule README documents, step by step in float64 (checks our reading of torch's)."""
    m = copy.deepcopy(m64)
    lr, (b1, b2), eps, wd = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"]
    state = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in m.named_parameters()}
    for step in range(1, STEPS + 1):
        m.zero_grad(set_to_none=True)
        hf_loss(m(ids)[0], labels).backward()
        with torch.no_grad():
            for n, p in m.named_parameters():
                mm, vv = state[n]
                g = p.grad
                p.mul_(1 - lr * wd)
                mm.mul_(b1).add_((1 - b1) * g)
                vv.mul_(b2).add_((1 - b2) * g * g)
                mhat = mm / (1 - b1 ** step)
                vhat = vv / (1 - b2 ** step)
                p.sub_(lr * mhat / (vhat.sqrt() + eps))
    return param_dict(m)


def check_model(name, out_root, r, inputs):
    d = r["dims"]
    ids, labels, targets = inputs
    outdir = os.path.join(out_root, name)
    # 1. Every file reads back, bit for bit, with the metadata written.
    for fname, (tensors, meta) in r["written"].items():
        got, gmeta = st_read(os.path.join(outdir, fname))
        expect(set(got) == set(tensors), f"{name}/{fname}: names differ")
        for n, t in tensors.items():
            expect(got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(got[n], t),
                   f"{name}/{fname}: {n} does not round-trip")
        expect(gmeta == {k: str(v) for k, v in meta.items()}, f"{name}/{fname}: metadata differs")
    cfg = json.load(open(os.path.join(outdir, "config.json")))
    expect(cfg == json.loads(json.dumps(CONFIGS[name])), f"{name}: config.json does not round-trip")
    P32, _ = st_read(os.path.join(outdir, "model.safetensors"))
    if r["shards"]:
        sdir = os.path.join(out_root, name + "_sharded")
        index = json.load(open(os.path.join(sdir, "model.safetensors.index.json")))
        merged = {}
        for f in r["shards"]:
            t, _ = st_read(os.path.join(sdir, f))
            expect(all(index["weight_map"][n] == f for n in t), f"{name}: index and shard {f} disagree")
            merged.update(t)
        expect(set(merged) == set(P32) == set(index["weight_map"]), f"{name}: shards do not hold the model")
        expect(all(torch.equal(merged[n], P32[n]) for n in P32), f"{name}: a shard's tensor differs")
        expect(index["metadata"]["total_size"] == sum(t.numel() * 4 for t in P32.values()), f"{name}: total_size")
    # 2. The independent loop-based forward from the file's tensors agrees with the vectorized one.
    P = {n: t.double() for n, t in P32.items()}
    logits, routers = naive_logits(P, d, ids)
    err = (logits - r["logits"]).abs().max().item()
    scale = r["logits"].abs().max().item()
    expect(err <= 1e-12 * max(1.0, scale), f"{name}: loop forward differs from the vectorized one by {err:.3e}")
    lerr = abs(naive_loss(logits, targets) - r["loss"].item())
    expect(lerr <= 1e-12, f"{name}: loss (shifted targets) differs by {lerr:.3e}")
    if d.experts:
        aerr = abs(naive_aux(routers, d) - r["aux"].item())
        expect(aerr <= 1e-12, f"{name}: aux loss differs by {aerr:.3e}")
    # 3. Gradients against central differences of the loss (float64), a few entries per tensor kind.
    m64 = r["m64"]
    g = torch.Generator().manual_seed(MODEL_SEED[name] + 7)
    picks = [n for n in P if not re.search(r"\.(layers|h)\.[1-9]", n)]  # every kind of tensor once

    def objective(total):
        lg, rt = m64(ids)
        v = hf_loss(lg, labels)
        return (v + d.aux_coef * aux_loss(rt, d)).item() if total else v.item()

    worst = 0.0
    with torch.no_grad():
        params = dict(m64.named_parameters())
        for total in ([False, True] if d.experts else [False]):
            for n in picks:
                p = params[n]
                flat = p.view(-1)
                for k in torch.randint(0, flat.numel(), (2,), generator=g).tolist():
                    h = 1e-6
                    keep = flat[k].item()
                    flat[k] = keep + h
                    up = objective(total)
                    flat[k] = keep - h
                    down = objective(total)
                    flat[k] = keep
                    fd = (up - down) / (2 * h)
                    an = r["grads"][("grad_total." if total else "grad.") + n].view(-1)[k].item()
                    worst = max(worst, abs(fd - an))
                    expect(abs(fd - an) <= 1e-7 + 1e-4 * abs(fd),
                           f"{name}: d loss/d {n}[{k}] = {an:.6e}, central difference {fd:.6e}")
    # 4. torch's AdamW equals the documented update rule.
    manual = manual_adamw(m64, ids, labels)
    aw = max((manual[n] - r["after64"][n]).abs().max().item() for n in manual)
    expect(aw <= 1e-12, f"{name}: torch's AdamW and the documented rule differ by {aw:.3e}")
    # 5. The reference tells plausible porting mistakes apart from f32 rounding.
    m32 = r["model"]
    spread = (m32(ids)[0].detach().double() - r["logits"]).abs().max().item()
    bugs = ["interleaved_rope", "gelu_for_silu"] if not d.gpt2 else ["gelu_erf", "c_proj_as_linear"]
    if d.kv_heads < d.heads:
        bugs.append("gqa_modulo")
    if d.window is not None and d.window < SEQ:
        bugs.append("window_off_by_one")
    if d.experts:
        bugs.append("moe_no_renorm")
    if d.rope_scaling is not None:
        bugs.append("no_rope_scaling")
    effects = {}
    for bug in bugs:
        wrong, _ = naive_logits(P, d, ids, bug=bug)
        effects[bug] = (wrong - r["logits"]).abs().max().item()
        expect(effects[bug] >= 100 * spread,
               f"{name}: the '{bug}' mistake moves logits by {effects[bug]:.2e}, under 100x the f32 spread {spread:.2e}")
    shown = ", ".join(f"{b} {e:.1e}" for b, e in effects.items())
    print(f"  check {name}: files round-trip; loop forward {err:.1e}; fd grads {worst:.1e}; adamw rule {aw:.1e}; "
          f"f32 logits spread {spread:.1e}; mistakes move logits by: {shown}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--models", default=",".join(MODEL_NAMES),
                    help="comma-separated subset of " + ",".join(MODEL_NAMES))
    ap.add_argument("--check", action="store_true", help="verify the files and the models (a few seconds more)")
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODEL_NAMES)}")
    torch_threads.set_threads(1)  # deterministic reductions, and polite on a shared machine (BLAS too)
    torch.use_deterministic_algorithms(True)
    t0 = time.time()
    os.makedirs(args.outdir, exist_ok=True)
    inputs = make_inputs()
    results = {n: reference(n, args.outdir, inputs) for n in names}
    if args.check:
        try:
            for n in names:
                check_model(n, args.outdir, results[n], inputs)
        except CheckFailed as e:
            print(f"reference_models.py: CHECK FAILED: {e}", file=sys.stderr)
            return 1
    print(f"reference_models.py: {len(names)} model(s) in {time.time() - t0:.1f} s (torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
