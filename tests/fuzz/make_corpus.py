#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (corpus/<target>/seed_*): small valid safetensors
files of every dtype, near-misses of each format rule, and the config.json fixtures with variants.
Crash regressions found by tools/fuzz live beside them as crash_* files and are never rewritten.
Run from anywhere: python3 tests/fuzz/make_corpus.py"""
import json
import os
import struct

here = os.path.dirname(os.path.abspath(__file__))
sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
         "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def st_file(tensors, metadata=None, pad=True, raw_header=None, extra=b""):
    """tensors: list of (name, dtype, shape, data bytes), laid out in order."""
    header, data, at = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, blob in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(blob)]}
        data += blob
        at += len(blob)
    h = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data + extra


def write(target, name, blob):
    d = os.path.join(here, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed_" + name), "wb") as f:
        f.write(blob)


t = "safetensors_header"
for dtype, size in sizes.items():
    blob = bytes((i * 37 + 1) % (2 if dtype == "BOOL" else 256) for i in range(3 * size))
    write(t, "one_" + dtype.lower(), st_file([("w", dtype, [3], blob)]))
write(t, "empty", st_file([]))
write(t, "metadata", st_file([("a", "F32", [1, 2], bytes(8))], metadata={"format": "pt"}))
write(t, "mixed", st_file([("big", "F64", [2], bytes(16)), ("mid", "BF16", [2, 2], bytes(8)),
                           ("z", "F32", [0], b""), ("m", "BOOL", [2], b"\x01\x00")]))
write(t, "misaligned", st_file([("b", "U8", [1], b"\x07"), ("f", "F32", [2], bytes(8))]))
write(t, "gap", st_file([], raw_header=b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', extra=b"\x00\x00"))
write(t, "overlap", st_file([], raw_header=b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                                          b'"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', extra=bytes(3)))
write(t, "duplicate", st_file([], raw_header=b'{"w":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},'
                                            b'"w":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'))
write(t, "huge_shape", st_file([], raw_header=b'{"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}}',
                               extra=bytes(8)))
write(t, "long_header_length", struct.pack("<Q", 1 << 40) + b"{}")

t = "model_config"
fixtures = os.path.join(here, "..", "io", "fixtures")
for name in sorted(n for n in os.listdir(fixtures) if n.endswith(".json")):
    with open(os.path.join(fixtures, name), "rb") as f:
        write(t, name.removesuffix(".json"), f.read())
write(t, "minimal_llama", json.dumps({"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
                                      "num_hidden_layers": 1, "num_attention_heads": 2}).encode())
write(t, "linear_rope", json.dumps({"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
                                    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "rope_scaling": {"type": "linear", "factor": 2.0}}).encode())
write(t, "qwen_window", json.dumps({"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
                                    "num_hidden_layers": 1, "num_attention_heads": 2, "use_sliding_window": True,
                                    "sliding_window": 4, "max_window_layers": 1}).encode())
write(t, "arch_only", json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8, "n_layer": 1, "n_head": 2,
                                  "vocab_size": 16}).encode())

t = "cluster_config"
clusters = os.path.join(here, "..", "..", "configs", "clusters")
for name in sorted(os.listdir(clusters)):
    with open(os.path.join(clusters, name), "rb") as f:
        write(t, name.removesuffix(".conf"), f.read())
write(t, "lines_units", b"# a smaller machine, with units\ncards = 16\nplanes = 4, ports_per_card = 8\nport_bandwidth = 800Gb/s\n"
                        b"port_latency = 0.2us // inline comment\nmemory = 16Gi\nshaping = on\nrouting = static\nfabric.transit = off\n")
write(t, "json_flat", json.dumps({"cards": 128, "supernodes": 8, "nic_bandwidth": "400Gb/s", "spines": 16, "seed": 7}).encode())
write(t, "json_nested", b"{\n  // nested groups, comments allowed\n" + json.dumps(
    {"cards_per_supernode": 16, "timing_only": True,
     "card": {"memory_bytes": "8Gi", "hbm_bandwidth": 1e12, "launch_overhead": "3us"},
     "fabric": {"planes": 4, "ports_per_card": 8, "port_bandwidth": "100GB/s", "routing": "static_plane",
                "shaping": True, "shaping_window": "64Ki", "switch_buffer": 1048576},
     "scaleout": {"supernodes": 2, "nic_bandwidth": 25e9, "spines": 4, "link_latency": "400ns"},
     "faults": {"op_timeout": "5ms", "link_failure_rate": 0.5, "horizon": 1e-2, "seed": 18446744073709551615}},
    indent=2)[1:].encode())
write(t, "json_errors", b'{"fabric": {"planes": "two", "plane": 4}, "planes": 4, "planes": 2, "cards": -3}')
write(t, "json_malformed", b'{"cards": 4,, "port_latency": 1e400')
write(t, "lines_errors", b"cards = 0\nport_bandwidth = 5us\nbogus line\nseed = 18446744073709551616\n")

# npy_file: the io tests' numpy-written fixtures (tests/io/fixtures/npy) are the seeds.
t = "npy_file"
npy_dir = os.path.join(here, "..", "io", "fixtures", "npy")
for name in sorted(os.listdir(npy_dir)):
    with open(os.path.join(npy_dir, name), "rb") as f:
        write(t, name[:-len(".npy")], f.read())

# checkpoint_manifest: [flags][manifest length, u32 LE][checkpoint.json][rank-00000.safetensors]
# (flags bit 0: the harness writes the rank file's true size and hash into the manifest).
t = "checkpoint_manifest"


def piece(param, kind, shape, first, last, values, dim=0, offset=0, length=None):
    place = {"param": param, "kind": kind, "shape": shape, "offset": offset,
             "length": (shape[dim] if shape else 1) if length is None else length, "dim": dim, "first": first, "last": last}
    name = kind + "/" + param + "/" + str(first)
    return name, json.dumps(place, separators=(",", ":")), struct.pack("<%df" % len(values), *values)


def checkpoint(pieces, manifest_extra=None, fix=True, files=None):
    meta = {name: place for name, place, _ in pieces}
    rank = st_file([(name, "F32", [len(blob) // 4], blob) for name, _, blob in pieces], metadata=meta)
    m = {"format": "tessel.checkpoint.v1", "step": 3, "extra": {"loader": "batch 3"}, "layout": {"dp": 1, "zero_stage": 0},
         "files": files if files is not None else [{"name": "rank-00000.safetensors", "bytes": len(rank), "hash": "0" * 16}]}
    m.update(manifest_extra or {})
    mb = json.dumps(m, indent=1).encode()
    return bytes([1 if fix else 0]) + struct.pack("<I", len(mb)) + mb + rank


w6 = [0.5 * i for i in range(6)]
write(t, "whole", checkpoint([piece("w", "value", [2, 3], 0, 6, w6), piece("w", "adamw.m", [2, 3], 0, 6, w6),
                               piece("b", "value", [3], 0, 3, w6[:3])]))
write(t, "shards", checkpoint([piece("w", "value", [4, 3], 0, 6, w6, dim=0, offset=2, length=2),
                                piece("w", "value", [4, 3], 0, 6, w6, dim=0, offset=0, length=2),
                                piece("u", "value", [2, 4], 0, 4, w6[:4], dim=1, offset=2, length=2)]))
write(t, "ranges", checkpoint([piece("w", "value", [2, 3], 0, 2, w6[:2]), piece("w", "value", [2, 3], 2, 6, w6[2:])]))
write(t, "gap", checkpoint([piece("w", "value", [2, 3], 0, 2, w6[:2]), piece("w", "value", [2, 3], 3, 6, w6[3:])]))
write(t, "scalar", checkpoint([piece("s", "value", [], 0, 1, [1.0])]))
write(t, "empty_dim", checkpoint([piece("e", "value", [0, 3], 0, 0, [])]))
write(t, "unfixed", checkpoint([piece("w", "value", [2, 3], 0, 6, w6)], fix=False))
write(t, "delta_self", checkpoint([piece("w", "value", [2, 3], 0, 6, w6)], {"base": "../c", "base_hash": "0123456789abcdef"}))
write(t, "delta_missing", checkpoint([piece("w", "value", [2, 3], 0, 6, w6)], {"base": "../nowhere", "base_hash": "0"}))
write(t, "bad_place", checkpoint([piece("w", "value", [2, 3], 4, 2, w6)]))
write(t, "escape", checkpoint([piece("w", "value", [2, 3], 0, 6, w6)],
                               files=[{"name": "../rank-00000.safetensors", "bytes": 1, "hash": "x"}]))
