#!/usr/bin/python3
"""ONNX reference models for tessel's importer (graph/onnx.hpp): six small networks built in plain
PyTorch, exported with torch.onnx.export at opsets 14 and 17 with a dynamic batch axis.

Usage: onnx_models.py OUTDIR [--models gpt2,bert,llama,resnet,vit,unet] [--check]
       onnx_models.py tests/graph/onnx --tiny      (the few-KB models committed for tests and fuzz seeds)
       onnx_models.py OUTDIR --size bench          (realistic sizes for the speed table, opset 17 only)

--size bench (see BENCH): BERT-base-like (768, 12 heads, ffn 3072, 4 layers, seq 128), GPT-2-small-like
(768, 12 heads, 4 layers, seq 128), Llama-like (768, 12 heads, 4 kv heads, SwiGLU 2048, 4 layers, seq 128),
ResNet-18 at 224x224, ViT-S/16-like (384, 6 heads, 6 layers, 224x224), U-Net (width 32) at 128x128; the
token models' vocabulary is 8192 so that the head does not dominate. Each <model>_op17.json then also holds
"flops_per_sample": 2 x the multiply-adds of every matmul and convolution PyTorch runs for one sample
(counted at the dispatcher, so attention's two matmuls are in), and the size's configuration.

Per model and opset, OUTDIR/<model>_op<opset>.onnx and <model>_op<opset>.json (ONNX's own op histogram
and initializer count of the file, for the C++ tests to compare with); per model, OUTDIR/<model>.io.safetensors holds
the inputs (names as the ONNX graph inputs, prefixed "input.") and PyTorch's outputs (prefixed
"output."), F32 or I64, written with reference_models.py's safetensors writer (the format C++ reads
through io/safetensors.hpp without new dependencies). Deterministic: fixed seeds, one thread.
--check runs ONNX's own checker on every file, reloads the safetensors and recomputes the outputs.
Shapes are fixed except the batch: every reshape uses -1 for the batch, so the graphs hold constant
shape operands (no Shape->Gather->Concat chains) and a tessel import can infer every value's shape.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_models import st_read, st_write  # noqa: E402
import torch_threads  # noqa: E402

SEED = 21_2026
OPSETS = (14, 17)
BATCH = 2


# ---- transformer pieces ------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def attention(q, k, v, mask):
    # q, k, v: (B, H, S, D); mask broadcasts to (B, H, S, S), additive
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(s, dim=-1) @ v


class GPT2Block(nn.Module):
    def __init__(self, d, h, seq):
        super().__init__()
        self.h, self.d, self.seq = h, d, seq
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        causal = torch.full((seq, seq), -1e9).triu(1)
        self.register_buffer("mask", causal, persistent=False)

    def forward(self, x):
        S, H, D = self.seq, self.h, self.d // self.h
        q, k, v = self.qkv(self.ln1(x)).split(self.d, dim=-1)
        q, k, v = (t.reshape(-1, S, H, D).transpose(1, 2) for t in (q, k, v))
        a = attention(q, k, v, self.mask).transpose(1, 2).reshape(-1, S, self.d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    inputs = {"ids": ((BATCH, 8), torch.int64)}

    def __init__(self, vocab=61, d=32, h=4, seq=8, layers=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(GPT2Block(d, h, seq) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(self.positions)
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.tok.weight.t()  # tied head


class BERTLayer(nn.Module):
    def __init__(self, d, h, seq, ffn=None):
        super().__init__()
        self.h, self.d, self.seq = h, d, seq
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)
        ffn = ffn or 2 * d
        self.fc, self.out = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x, mask):
        S, H, D = self.seq, self.h, self.d // self.h
        q, k, v = (f(x).reshape(-1, S, H, D).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = attention(q, k, v, mask).transpose(1, 2).reshape(-1, S, self.d)
        x = self.ln1(x + self.o(a))
        return self.ln2(x + self.out(F.gelu(self.fc(x))))  # erf GELU, post-norm


class BERT(nn.Module):
    inputs = {"ids": ((BATCH, 8), torch.int64), "attention_mask": ((BATCH, 8), torch.int64)}

    def __init__(self, vocab=61, d=32, h=4, seq=8, layers=2, ffn=None):
        super().__init__()
        self.tok, self.pos, self.typ = nn.Embedding(vocab, d), nn.Embedding(seq, d), nn.Embedding(2, d)
        self.ln = nn.LayerNorm(d, eps=1e-12)
        self.layers = nn.ModuleList(BERTLayer(d, h, seq, ffn) for _ in range(layers))
        self.pool = nn.Linear(d, d)
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, ids, attention_mask):
        x = self.ln(self.tok(ids) + self.pos(self.positions) + self.typ.weight[0])
        mask = (1.0 - attention_mask.to(torch.float32)).unsqueeze(1).unsqueeze(2) * -1e9
        for layer in self.layers:
            x = layer(x, mask)
        return x, torch.tanh(self.pool(x[:, 0]))


class LlamaLayer(nn.Module):
    def __init__(self, d, h, kv, seq, ffn=48):
        super().__init__()
        self.d, self.h, self.kv, self.hd, self.seq = d, h, kv, d // h, seq
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.q = nn.Linear(d, h * self.hd, bias=False)
        self.k = nn.Linear(d, kv * self.hd, bias=False)
        self.v = nn.Linear(d, kv * self.hd, bias=False)
        self.o = nn.Linear(h * self.hd, d, bias=False)
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)
        self.register_buffer("kv_of_head", torch.arange(h) // (h // kv), persistent=False)

    def rope(self, x, cos, sin):
        half = self.hd // 2  # not x.shape[-1] // 2, which traces into Shape arithmetic
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def forward(self, x, cos, sin, mask):
        S, D = self.seq, self.hd
        y = self.n1(x)
        q = self.rope(self.q(y).reshape(-1, S, self.h, D).transpose(1, 2), cos, sin)
        k = self.rope(self.k(y).reshape(-1, S, self.kv, D).transpose(1, 2), cos, sin)
        v = self.v(y).reshape(-1, S, self.kv, D).transpose(1, 2)
        # GQA: query head i reads kv head i // (h / kv); a Gather by a constant index keeps the export
        # free of the Shape/ConstantOfShape/Expand chain that expand(-1, ...) traces into.
        k, v = k.index_select(1, self.kv_of_head), v.index_select(1, self.kv_of_head)
        a = attention(q, k, v, mask).transpose(1, 2).reshape(-1, S, self.h * D)
        x = x + self.o(a)
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    inputs = {"ids": ((BATCH, 8), torch.int64)}

    def __init__(self, vocab=61, d=32, h=4, kv=2, seq=8, layers=2, theta=1e4, ffn=48):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaLayer(d, h, kv, seq, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // h
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        self.register_buffer("mask", torch.full((seq, seq), -1e9).triu(1), persistent=False)

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, self.mask)
        return self.head(self.norm(x))


# ---- CNNs ---------------------------------------------------------------------------------------

def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1, self.c2 = conv_bn(cin, cout, stride), conv_bn(cout, cout)
        self.skip = None
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.c2(F.relu(self.c1(x)))
        return F.relu(y + (x if self.skip is None else self.skip(x)))


class ResNet(nn.Module):
    inputs = {"image": ((BATCH, 3, 32, 32), torch.float32)}

    def __init__(self, widths=(8, 16, 24, 32), classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):  # ResNet-18: two basic blocks per stage
            blocks += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, image):
        x = self.blocks(self.stem(image))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ViT(nn.Module):
    inputs = {"image": ((BATCH, 3, 16, 16), torch.float32)}

    def __init__(self, patch=4, d=32, h=4, layers=2, classes=10, image=16, ffn=None):
        super().__init__()
        n = (image // patch) ** 2
        self.n, self.d = n, d
        self.patch = nn.Conv2d(3, d, patch, patch)
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, d))
        self.pos = nn.Parameter(0.02 * torch.randn(1, n + 1, d))
        self.layers = nn.ModuleList(ViTLayer(d, h, n + 1, ffn) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, image):
        x = self.patch(image).reshape(-1, self.d, self.n).transpose(1, 2)  # (B, N, d); flatten(2) traces Shape ops
        cls = x[:, :1] * 0.0 + self.cls  # the class token per batch row, without shape arithmetic
        x = torch.cat((cls, x), dim=1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x[:, 0]))


class ViTLayer(nn.Module):
    def __init__(self, d, h, seq, ffn=None):
        super().__init__()
        self.d, self.h, self.seq = d, h, seq
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        ffn = ffn or 2 * d
        self.fc, self.out = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        S, H, D = self.seq, self.h, self.d // self.h
        qkv = self.qkv(self.ln1(x)).reshape(-1, S, 3, H, D).permute(2, 0, 3, 1, 4)
        a = attention(qkv[0], qkv[1], qkv[2], 0.0).transpose(1, 2).reshape(-1, S, self.d)
        x = x + self.o(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class UNet(nn.Module):
    """Two levels down, two up; upsampling by Resize (nearest, scale 2): F.interpolate exports as one
    Resize op, which keeps the graph's op set small (ConvTranspose would be a second conv kind)."""
    inputs = {"image": ((BATCH, 3, 32, 32), torch.float32)}

    def __init__(self, w=8, classes=4):
        super().__init__()

        def double(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
        self.e1, self.e2, self.mid = double(3, w), double(w, 2 * w), double(2 * w, 4 * w)
        self.d2, self.d1 = double(6 * w, 2 * w), double(3 * w, w)
        self.head = nn.Conv2d(w, classes, 1)

    def forward(self, image):
        e1 = self.e1(image)
        e2 = self.e2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.d2(torch.cat((F.interpolate(m, scale_factor=2.0, mode="nearest"), e2), dim=1))
        d1 = self.d1(torch.cat((F.interpolate(d2, scale_factor=2.0, mode="nearest"), e1), dim=1))
        return self.head(d1)


MODELS = {"gpt2": GPT2, "bert": BERT, "llama": Llama, "resnet": ResNet, "vit": ViT, "unet": UNet}
MODEL_SEED = {name: SEED + 101 * i for i, name in enumerate(MODELS)}
MODEL_SEED.update({"gpt2_tiny": SEED + 7, "llama_tiny": SEED + 8, "unet_tiny": SEED + 9})
OUTPUTS = {"bert": ["hidden", "pooled"]}
I64 = torch.int64
# --size bench: name -> (model, constructor arguments, inputs at batch 1); the seeds are the default size's.
BENCH = {
    "gpt2": (GPT2, dict(vocab=8192, d=768, h=12, seq=128, layers=4), {"ids": ((1, 128), I64)}),
    "bert": (BERT, dict(vocab=8192, d=768, h=12, seq=128, layers=4, ffn=3072),
             {"ids": ((1, 128), I64), "attention_mask": ((1, 128), I64)}),
    "llama": (Llama, dict(vocab=8192, d=768, h=12, kv=4, seq=128, layers=4, ffn=2048), {"ids": ((1, 128), I64)}),
    "resnet": (ResNet, dict(widths=(64, 128, 256, 512), classes=1000), {"image": ((1, 3, 224, 224), torch.float32)}),
    "vit": (ViT, dict(patch=16, d=384, h=6, layers=6, classes=1000, image=224, ffn=1536),
            {"image": ((1, 3, 224, 224), torch.float32)}),
    "unet": (UNet, dict(w=32, classes=4), {"image": ((1, 3, 128, 128), torch.float32)}),
}
# The few-KB models committed under tests/graph/onnx/ (--tiny DIR): importer tests and the fuzz seeds.
# name -> (model, constructor arguments, inputs, opsets); opset 11 is there for the version converter.
TINY = {
    "gpt2_tiny": (GPT2, dict(vocab=11, d=8, h=2, seq=4, layers=1), {"ids": ((BATCH, 4), torch.int64)}, (14, 17)),
    "llama_tiny": (Llama, dict(vocab=11, d=8, h=2, kv=1, seq=4, layers=1), {"ids": ((BATCH, 4), torch.int64)}, (17,)),
    "unet_tiny": (UNet, dict(w=2, classes=2), {"image": ((BATCH, 3, 8, 8), torch.float32)}, (11, 17)),
}


def build(name, size="test"):
    torch.manual_seed(MODEL_SEED[name])
    if size == "bench":
        cls, kw, _ = BENCH[name]
        m = cls(**kw)
    elif name in TINY:
        cls, kw, _, _ = TINY[name]
        m = cls(**kw)
    else:
        m = MODELS[name]()
    if name in ("resnet", "unet", "unet_tiny"):  # BN running stats that are not the identity
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.copy_(0.1 * torch.randn(mod.num_features))
                mod.running_var.copy_(1 + 0.2 * torch.rand(mod.num_features))
    m.eval()
    g = torch.Generator().manual_seed(MODEL_SEED[name] + 1)
    inputs = {}
    spec = BENCH[name][2] if size == "bench" else TINY[name][2] if name in TINY else MODELS[name].inputs
    for k, (shape, dt) in spec.items():
        if dt == torch.int64:
            hi = 2 if k == "attention_mask" else m.tok.num_embeddings
            inputs[k] = torch.randint(0, hi, shape, generator=g)
            if k == "attention_mask":
                inputs[k][:, 0] = 1
        else:
            inputs[k] = torch.randn(shape, generator=g)
    return m, inputs


def export(name, outdir, opset, size="test"):
    m, inputs = build(name, size)
    names = list(inputs)
    outs = OUTPUTS.get(name, ["output"])
    dyn = {k: {0: "batch"} for k in names + outs}
    path = os.path.join(outdir, f"{name}_op{opset}.onnx")
    with torch.no_grad():
        torch.onnx.export(m, tuple(inputs[k] for k in names), path, input_names=names, output_names=outs,
                          dynamic_axes=dyn, opset_version=opset, do_constant_folding=True)
    return m, inputs, outs, path


def count_flops(m, inputs):
    """2 x the multiply-adds of the matmuls and convolutions one forward runs, counted at the dispatcher
    (so matmuls written as `@` and attention's two batched matmuls are in; elementwise ops, norms and
    softmax are not)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    aten = torch.ops.aten

    def prod(xs):
        n = 1
        for x in xs:
            n *= int(x)
        return n

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.macs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            p = func.overloadpacket
            if p in (aten.mm, aten.bmm):
                a, b = args[0], args[1]
                self.macs += prod(a.shape) * b.shape[-1]
            elif p in (aten.addmm, aten.baddbmm):
                a, b = args[1], args[2]
                self.macs += prod(a.shape) * b.shape[-1]
            elif p == aten.convolution:
                w = args[1]  # (O, C/groups, KH, KW): each output element takes C/groups*KH*KW MACs
                self.macs += prod(out.shape) * prod(w.shape[1:])
            return out

    c = Count()
    with torch.no_grad(), c:
        m(*inputs.values())
    return 2 * c.macs


def write_manifest(path, extra=None):
    """<model>_op<opset>.json beside the model: ONNX's own count of each op type (Constant included)
    and the initializer count, read back with onnx.load, for the C++ side to compare its import with."""
    import onnx
    m = onnx.load(path)
    ops = {}
    for n in m.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    manifest = {"ops": dict(sorted(ops.items())), "nodes": len(m.graph.node),
                "initializers": len(m.graph.initializer),
                "opset": [i.version for i in m.opset_import if i.domain in ("", "ai.onnx")][0]}
    manifest.update(extra or {})
    with open(path[:-len(".onnx")] + ".json", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="write the tiny committed models (tests/graph/onnx/) instead")
    ap.add_argument("--size", choices=["test", "bench"], default="test",
                    help="test: the small models the tests use (default); bench: realistic sizes, opset 17, no io file")
    a = ap.parse_args()
    if a.tiny and a.size != "test":
        sys.exit("onnx_models.py: --tiny and --size bench exclude each other")
    torch_threads.set_threads(1)  # its BLAS too
    torch.use_deterministic_algorithms(True)
    if a.size == "bench":
        os.makedirs(a.outdir, exist_ok=True)
        for name in a.models.split(","):
            if name not in BENCH:
                sys.exit(f"onnx_models.py: unknown model '{name}' (known: {', '.join(BENCH)})")
            m, inputs, _, path = export(name, a.outdir, 17, "bench")
            one = {k: v[:1] for k, v in inputs.items()}
            flops = count_flops(m, one)
            cls, kw, _ = BENCH[name]
            write_manifest(path, {"flops_per_sample": flops, "size": "bench", "model": name,
                                  "config": {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()},
                                  "inputs": {k: list(s[1:]) for k, (s, _) in BENCH[name][2].items()}})
            if a.check:
                import onnx
                onnx.checker.check_model(onnx.load(path), full_check=True)
            print(f"{name}: {os.path.getsize(path) / 1e6:.1f} MB, {flops / 1e9:.2f} GFLOP per sample", flush=True)
        return
    if a.tiny:
        os.makedirs(a.outdir, exist_ok=True)
        for name, (_, _, _, opsets) in TINY.items():
            for opset in opsets:
                _, _, _, path = export(name, a.outdir, opset)
                print(f"{os.path.basename(path)}: {os.path.getsize(path)} B")
        return
    os.makedirs(a.outdir, exist_ok=True)
    for name in a.models.split(","):
        if name not in MODELS:
            sys.exit(f"onnx_models.py: unknown model '{name}' (known: {', '.join(MODELS)})")
        for opset in OPSETS:
            m, inputs, outs, path = export(name, a.outdir, opset)
            write_manifest(path)
        with torch.no_grad():
            y = m(*inputs.values())
        y = y if isinstance(y, tuple) else (y,)
        tensors = {f"input.{k}": v.contiguous() for k, v in inputs.items()}
        tensors.update({f"output.{k}": v.contiguous() for k, v in zip(outs, y)})
        io_path = os.path.join(a.outdir, f"{name}.io.safetensors")
        st_write(io_path, tensors, {"generator": "tools/torch/onnx_models.py", "model": name})
        sizes = ", ".join(f"op{o} {os.path.getsize(os.path.join(a.outdir, f'{name}_op{o}.onnx'))} B" for o in OPSETS)
        print(f"{name}: {sizes}")
        if a.check:
            import onnx
            for opset in OPSETS:
                model = onnx.load(os.path.join(a.outdir, f"{name}_op{opset}.onnx"))
                onnx.checker.check_model(model, full_check=True)
                got = [imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")]
                assert got == [opset], f"{name}: opset {got}, expected {opset}"
                assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim][0] == "batch"
            back = st_read(io_path)
            back = back[0] if isinstance(back, tuple) else back
            m2, inputs2 = build(name)
            with torch.no_grad():
                y2 = m2(*(back[f"input.{k}"] for k in inputs2))
            y2 = y2 if isinstance(y2, tuple) else (y2,)
            for k, v in zip(outs, y2):
                assert torch.equal(torch.as_tensor(back[f"output.{k}"]), v), f"{name}: output {k} differs on reload"
            print(f"{name}: checked (ONNX checker, opsets, symbolic batch, reload)")


if __name__ == "__main__":
    main()
