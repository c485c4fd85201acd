#!/usr/bin/python3
"""Writes the hand-made seeds of the onnx_model fuzz target (corpus/onnx_model/seed_*): a small MLP
at opsets 17 and 9 (the version converter's path), one whose weight sits in external data, one with
Constant nodes of each value kind, and one with typed-field initializers. The exported models of
tests/graph/onnx/ are seeds too (tools/fuzz passes that folder). Needs python3-onnx."""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "onnx_model")


def mlp(opset, weight=None, extra_nodes=(), extra_inits=(), outputs=("y",)):
    w = weight if weight is not None else numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 2, "w")
    b = helper.make_tensor("b", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])  # float_data
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Add", ["h", "b"], ["z"], name="bias"),
             helper.make_node("Relu", ["z"], ["y"], name="act"), *extra_nodes]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])]
    outs += [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs if o != "y"]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])], outs,
                          [w, b, *extra_inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="make_onnx_corpus")
    m.ir_version = 8 if opset >= 13 else 4
    return m


def main():
    os.makedirs(here, exist_ok=True)
    seeds = {"seed_mlp_op17": mlp(17), "seed_mlp_op9": mlp(9)}
    ext = onnx.TensorProto()
    ext.name, ext.data_type, ext.data_location = "w", TensorProto.FLOAT, TensorProto.EXTERNAL
    ext.dims.extend([4, 3])
    for k, v in (("location", "weights.bin"), ("offset", "0"), ("length", "48")):
        e = ext.external_data.add()
        e.key, e.value = k, v
    seeds["seed_external"] = mlp(17, weight=ext)
    consts = [helper.make_node("Constant", [], ["ci"], name="c_i", value_int=3),
              helper.make_node("Constant", [], ["cis"], name="c_is", value_ints=[1, 2]),
              helper.make_node("Constant", [], ["cf"], name="c_f", value_float=0.5),
              helper.make_node("Constant", [], ["cfs"], name="c_fs", value_floats=[1.5, 2.5]),
              helper.make_node("Constant", [], ["ct"], name="c_t", value=helper.make_tensor("t", TensorProto.INT64, [2], [4, 5]))]
    seeds["seed_constants"] = mlp(17, extra_nodes=consts, outputs=("y", "ci", "cis", "cf", "cfs", "ct"))
    typed = [helper.make_tensor("i8", TensorProto.INT8, [2], [-1, 1]), helper.make_tensor("f16", TensorProto.FLOAT16, [1], [1.0]),
             helper.make_tensor("i64", TensorProto.INT64, [2], [7, 8]), helper.make_tensor("d", TensorProto.DOUBLE, [1], [2.0])]
    seeds["seed_typed"] = mlp(17, extra_inits=typed, outputs=("y", "i8", "f16", "i64", "d"))
    for name, m in seeds.items():
        with open(os.path.join(here, name), "wb") as f:
            f.write(m.SerializeToString())
        print(name, os.path.getsize(os.path.join(here, name)))


if __name__ == "__main__":
    main()
