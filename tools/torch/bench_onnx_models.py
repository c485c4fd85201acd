#!/usr/bin/python3
"""Issue 21's speed table: the fused tessel graph (import_onnx, optimize, compile, run) against PyTorch
1.13 eager on the same six models at bench size, per model x batch x threads x dtype, paired in one run.

Usage: bench_onnx_models.py [--dir build/bench_models] [--binary build/default/bench/bench_graph_models]
                            [--models gpt2,bert,llama,resnet,vit,unet] [--batches 1,8] [--threads 1,2]
                            [--dtypes f32,bf16] [--reps 3] [--out results.json]

Models missing from --dir are written first (onnx_models.py DIR --size bench --models ...). Then, model
by model: PyTorch eager (torch.inference_mode, t threads for its pool and its BLAS alike as
torch_threads.set_threads pins them, bf16 as torch.autocast("cpu", bfloat16)) times one forward per repetition after a warm-up call, for every case of the model; then the
tessel binary runs the same cases (--benchmark_format=json, one iteration per repetition after its own
warm-up run) in a subprocess. Alternating per model keeps each pair close in time on a loaded machine.
The table: min and median ms of each, ratio torch/tessel of the medians (> 1: tessel is faster), for
low-precision rows also PyTorch's f32 median over tessel's (the issue's "≥ 2x PyTorch's f32 run"),
PyTorch's CPU time over wall time in its timed runs (about t when it kept to t threads; a warning names
any case above t + 0.15), tessel's GFLOP/s at its median time (flops_per_sample from the model's manifest x batch) and its share
of the machine's measured peak for the dtype (FP32 FMA for f32, the BF16 dot for bf16, as
bench/common/limits.hpp measures it in the same process), and the geomean ratio over the cases both ran.
A case tessel cannot run (an op without a kernel) is listed with the executor's message.
Run with Debian's interpreter (/usr/bin/python3), which has PyTorch.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.realpath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import onnx_models as om  # noqa: E402
import torch_threads  # noqa: E402


def csv(s, conv=str):
    return [conv(x) for x in s.split(",") if x]


def ensure_models(d, models):
    missing = [m for m in models if not (os.path.exists(os.path.join(d, f"{m}_op17.onnx"))
                                         and os.path.exists(os.path.join(d, f"{m}_op17.json")))]
    if missing:
        print(f"writing bench models {','.join(missing)} to {d}", flush=True)
        subprocess.run([sys.executable, os.path.join(HERE, "onnx_models.py"), d, "--size", "bench",
                        "--models", ",".join(missing)], check=True)
    flops = {}
    for m in models:
        with open(os.path.join(d, f"{m}_op17.json")) as f:
            flops[m] = json.load(f)["flops_per_sample"]
    return flops


def torch_inputs(name, batch):
    g = torch.Generator().manual_seed(1)
    out = {}
    for k, (shape, dt) in om.BENCH[name][2].items():
        shape = (batch,) + tuple(shape[1:])
        if dt == torch.int64:
            out[k] = torch.ones(shape, dtype=dt) if "mask" in k else torch.randint(0, 8, shape, generator=g)
        else:
            out[k] = torch.rand(shape, generator=g) * 2 - 1
    return out


def time_torch(m, name, batch, threads, dtype, reps):
    """(per-repetition ms of one eager forward, CPU seconds / wall seconds over them), or an error string."""
    torch_threads.set_threads(threads)
    x = torch_inputs(name, batch)
    try:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=(dtype == "bf16")):
            m(*x.values())  # warm-up
            ms = []
            cpu0 = torch_threads.cpu_seconds()
            for _ in range(reps):
                t0 = time.perf_counter()
                m(*x.values())
                ms.append((time.perf_counter() - t0) * 1e3)
            cpu = torch_threads.cpu_seconds() - cpu0
        return ms, cpu / (sum(ms) * 1e-3)
    except Exception as e:  # an op without a bf16 CPU kernel, say
        return f"{type(e).__name__}: {e}"


def time_tessel(binary, d, name, cases, reps):
    """{(batch, threads, dtype): {"ms": [...], "peak": FLOP/s or None} or an error string}."""
    batches = sorted({c[0] for c in cases})
    threads = sorted({c[1] for c in cases})
    dtypes = sorted({c[2] for c in cases})
    cmd = [binary, f"--models_dir={d}", f"--batches={','.join(map(str, batches))}",
           f"--threads={','.join(map(str, threads))}", f"--dtypes={','.join(dtypes)}",
           f"--benchmark_filter=^graph_models/tessel/{name}_op17/", f"--benchmark_repetitions={reps}",
           "--benchmark_min_time=0.000001", "--benchmark_format=json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        msg = p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        return {c: f"bench_graph_models failed: {msg[0]}" for c in cases}
    res = {}
    for b in json.loads(p.stdout)["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        parts = b["run_name"].split("/")  # graph_models/tessel/<model>/batch:B/threads:T/<dtype>
        key = (int(parts[3].split(":")[1]), int(parts[4].split(":")[1]), parts[5])
        if b.get("error_occurred"):
            res[key] = b.get("error_message", "error")
            continue
        r = res.setdefault(key, {"ms": [], "peak": None})
        assert b["time_unit"] == "ms"
        r["ms"].append(b["real_time"])
        if b.get("of_limit"):
            r["peak"] = b["flops"] / b["of_limit"]
    return res


def fmt(ms):
    return f"{min(ms):9.2f} {statistics.median(ms):9.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.path.join(ROOT, "build", "bench_models"))
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "default", "bench", "bench_graph_models"))
    ap.add_argument("--models", default=",".join(om.BENCH))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="also write the rows as JSON")
    a = ap.parse_args()
    models = csv(a.models)
    for m in models:
        if m not in om.BENCH:
            sys.exit(f"bench_onnx_models.py: unknown model '{m}' (known: {', '.join(om.BENCH)})")
    dtypes = csv(a.dtypes)
    if any(t not in ("f32", "bf16") for t in dtypes):
        sys.exit("bench_onnx_models.py: --dtypes takes f32 and/or bf16")
    if a.reps < 1:
        sys.exit("bench_onnx_models.py: --reps must be at least 1")
    if not os.access(a.binary, os.X_OK):
        sys.exit(f"bench_onnx_models.py: no benchmark binary {a.binary} "
                 "(cmake --build build/default -j1 --target bench_graph_models)")
    flops = ensure_models(a.dir, models)
    cases = [(b, t, d) for b in csv(a.batches, int) for t in csv(a.threads, int) for d in dtypes]
    blas = torch_threads.set_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}; {a.reps} repetitions; "
          f"BLAS thread counts set in {', '.join(blas) if blas else 'no library (torch.set_num_threads only)'}",
          flush=True)
    rows, errors = [], {}
    for name in models:
        tr = {}
        m, _ = om.build(name, "bench")  # the weights the ONNX file holds (same seed)
        for c in cases:
            tr[c] = time_torch(m, name, *c, a.reps)
            print(f"  torch  {name} b{c[0]} t{c[1]} {c[2]}: "
                  f"{fmt(tr[c][0]) + f'  cpu/wall {tr[c][1]:.2f}' if isinstance(tr[c], tuple) else tr[c]}", flush=True)
        te = time_tessel(a.binary, a.dir, name, cases, a.reps)
        for c in cases:
            t = te.get(c, "no result")
            print(f"  tessel {name} b{c[0]} t{c[1]} {c[2]}: {fmt(t['ms']) if isinstance(t, dict) else t}", flush=True)
            row = {"model": name, "batch": c[0], "threads": c[1], "dtype": c[2],
                   "flops": flops[name] * c[0], "torch_ms": tr[c][0] if isinstance(tr[c], tuple) else None,
                   "torch_cpu_per_wall": tr[c][1] if isinstance(tr[c], tuple) else None,
                   "tessel_ms": t["ms"] if isinstance(t, dict) else None,
                   "peak": t["peak"] if isinstance(t, dict) else None}
            if not isinstance(t, dict):
                errors.setdefault(name, t)
            if not isinstance(tr[c], tuple):
                row["torch_error"] = tr[c]
            rows.append(row)

    print(f"\nload average at the end {os.getloadavg()[0]:.2f} (the machine is shared: numbers are noisy)\n")
    print("| model | batch | thr | dtype | GFLOP | torch ms min | torch ms med | tessel ms min | tessel ms med "
          "| torch cpu/wall | torch/tessel | torch f32/tessel | tessel GFLOP/s | of peak |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    # issue 21's bf16 target is against PyTorch's f32 run: at the same thread count, and against its
    # best f32 time over the thread counts measured (its 2-thread f32 runs can be slower than 1-thread)
    f32_med = {(r["model"], r["batch"], r["threads"]): statistics.median(r["torch_ms"])
               for r in rows if r["dtype"] == "f32" and r["torch_ms"]}
    for r in rows:
        tm, sm = r["torch_ms"], r["tessel_ms"]
        cells = [r["model"], str(r["batch"]), str(r["threads"]), r["dtype"], f"{r['flops'] / 1e9:.2f}"]
        cells += [f"{min(tm):.2f}", f"{statistics.median(tm):.2f}"] if tm else ["n/a", "n/a"]
        cells += [f"{min(sm):.2f}", f"{statistics.median(sm):.2f}"] if sm else ["fail", "fail"]
        cells.append(f"{r['torch_cpu_per_wall']:.2f}" if tm else "-")
        if tm and sm:
            q = statistics.median(tm) / statistics.median(sm)
            ratios.setdefault(r["dtype"], []).append(q)
            ratios.setdefault(f"{r['dtype']}, {r['threads']} thread(s)", []).append(q)
            cells.append(f"{q:.2f}")
        else:
            cells.append("-")
        key = (r["model"], r["batch"], r["threads"])
        if r["dtype"] != "f32" and sm and key in f32_med:
            q = f32_med[key] / statistics.median(sm)
            best = min(v for k, v in f32_med.items() if k[:2] == key[:2])
            ratios.setdefault(f"{r['dtype']} vs torch f32, same threads", []).append(q)
            ratios.setdefault(f"{r['dtype']} vs torch f32 at its best thread count", []).append(best / statistics.median(sm))
            cells.append(f"{q:.2f}")
        else:
            cells.append("-")
        if sm:
            rate = r["flops"] / (statistics.median(sm) * 1e-3)
            cells.append(f"{rate / 1e9:.1f}")
            cells.append(f"{100 * rate / r['peak']:.1f}%" if r["peak"] else "-")
        else:
            cells += ["-", "-"]
        print("| " + " | ".join(cells) + " |")
    def geomean(qs):
        return math.exp(sum(map(math.log, qs)) / len(qs))

    allq = [q for d in dtypes for q in ratios.get(d, [])]
    print()
    for d, qs in sorted(ratios.items()):  # per dtype, and per dtype and thread count
        print(f"geomean torch/tessel ({d}, {len(qs)} cases): {geomean(qs):.3f}")
    if allq:
        print(f"geomean torch/tessel (all, {len(allq)} cases): {geomean(allq):.3f}")
    for name, e in errors.items():
        print(f"tessel cannot run {name}: {e}")
    for r in rows:
        if r["torch_ms"] and r["torch_cpu_per_wall"] > r["threads"] + 0.15:
            print(f"warning: torch {r['model']} b{r['batch']} t{r['threads']} {r['dtype']} used "
                  f"{r['torch_cpu_per_wall']:.2f} CPUs on average, more than its {r['threads']} thread(s)")
    for r in rows:
        if "torch_error" in r:
            print(f"torch cannot run {r['model']} b{r['batch']} t{r['threads']} {r['dtype']}: {r['torch_error']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
