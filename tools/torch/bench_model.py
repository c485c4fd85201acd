#!/usr/bin/python3
"""PyTorch's side of bench_model: one training step (forward, cross-entropy, backward, AdamW) of the
same Llama-style model tessel's bench/model.cpp times, in f32 and under bf16 autocast, on N threads.

Usage: bench_model.py [--threads 2] [--reps 3] [--dtype f32|bf16|both] [--memory]
Prints one line per dtype: `torch <dtype> step_ms min <x> median <y>` (after one warm-up step).
--memory adds, per dtype, `torch <dtype> peak_MiB <p> saved_MiB <s>`: p = the process's peak resident
memory over the steps above its level before the model was built (VmHWM after a clear_refs reset,
as bench/model.cpp's peak_MiB counter), s = the bytes of the distinct tensors autograd saved for
backward in one step (the activations the step keeps). Run each dtype in its own process
(--dtype f32, then --dtype bf16) for a peak not inflated by the previous model.
The model is reference_models.RotaryLM (Hugging Face Llama semantics) with bench/model.cpp's sizes.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
import reference_models as rm  # noqa: E402
import torch_threads  # noqa: E402

# Keep in step with bench/model.cpp's small model.
CONFIG = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False}
BATCH, SEQ = 4, 512


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="both", choices=["f32", "bf16", "both"])
    ap.add_argument("--memory", action="store_true")
    a = ap.parse_args()
    torch_threads.set_threads(a.threads)  # its BLAS too
    torch.manual_seed(0)
    d = rm.Dims(CONFIG)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, d.vocab, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, d.vocab, (BATCH, SEQ), generator=g)
    for dt in (["f32", "bf16"] if a.dtype == "both" else [a.dtype]):
        reset_ok = reset_peak()
        base = status_bytes("VmRSS")
        m = rm.RotaryLM(d)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(dt == "bf16")):
                logits, _ = m(ids)
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, d.vocab), targets.reshape(-1))
            loss.backward()
            opt.step()

        saved = {}

        def pack(t):
            # one entry per storage: views of one buffer are counted once
            st = t.storage() if hasattr(t, "storage") else t.untyped_storage()
            saved[st.data_ptr()] = st.nbytes()
            return t

        if a.memory:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                step()  # warm-up, recording what backward keeps
        else:
            step()  # warm-up
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"torch {dt} step_ms min {min(times):.1f} median {statistics.median(times):.1f}", flush=True)
        if a.memory:
            peak = (status_bytes("VmHWM") - base) / 2**20 if reset_ok else -1.0
            print(f"torch {dt} peak_MiB {peak:.0f} saved_MiB {sum(saved.values()) / 2**20:.0f}", flush=True)


if __name__ == "__main__":
    main()
