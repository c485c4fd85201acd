#!/usr/bin/env bash
# Runs the examples that take arguments over impossible ones: each must exit 2 with a message on
# stderr (no crash, no silent run with a number read up to its garbage).
# Usage: tests/tools/examples_args.sh path/to/build/examples path/to/source
set -u
dir=$1
src=$2
fails=0
total=0
bad() {
  local exe=$1; shift
  local err rc
  total=$((total + 1))
  err=$(timeout 60 "$dir/$exe" "$@" 2>&1 >/dev/null); rc=$?
  if [[ $rc -ne 2 ]] || [[ -z $err ]]; then
    echo "FAIL: $exe $* -> exit $rc, stderr '${err:0:200}'"; fails=$((fails + 1))
  else
    echo "ok:   $exe $* -> exit $rc: ${err%%$'\n'*}"
  fi
}
bad 03_fused_gemm_bias_gelu abc def ghi
bad 03_fused_gemm_bias_gelu 300
bad 03_fused_gemm_bias_gelu 0 1 1
bad 03_fused_gemm_bias_gelu 8x 8 8
bad 03_fused_gemm_bias_gelu 99999999999999999999 1 1
bad 03_fused_gemm_bias_gelu 1 2 3 4
bad 40_train_byte_llama 0
bad 40_train_byte_llama 12x
bad 40_train_byte_llama -5
bad 40_train_byte_llama 1 a b c
bad 41_generate_byte_llama - 0
bad 41_generate_byte_llama - 101
bad 41_generate_byte_llama - 5 -1
bad 41_generate_byte_llama - 5x
model=$src/configs/models/llama-3.1-8b.json
cluster=$src/configs/clusters/ubl128.conf
bad 50_plan_3d_parallelism "$model" "$cluster" 0
bad 50_plan_3d_parallelism "$model" "$cluster" 10x
bad 50_plan_3d_parallelism "$model" "$cluster" 1024 -4096
bad 50_plan_3d_parallelism "$model" "$cluster" 1024 4096 extra
bad 90_data_parallel_ubl128 0
bad 90_data_parallel_ubl128 129
bad 90_data_parallel_ubl128 8 0
bad 90_data_parallel_ubl128 8x
bad 90_data_parallel_ubl128 -1
bad 90_data_parallel_ubl128 8 10 trace.json extra
bad 91_elastic_ubl128 9
bad 91_elastic_ubl128 100001
bad 91_elastic_ubl128 12x
bad 91_elastic_ubl128 300 extra
bad 20_ubl128_experiments trace.json extra
bad 33_emulated_all_reduce plot.svg extra
bad 33_emulated_all_reduce /nonexistent-tessel-dir/plot.svg
bad 20_ubl128_experiments /nonexistent-tessel-dir/trace.json
bad 90_data_parallel_ubl128 8 10 /nonexistent-tessel-dir/trace.json
echo "$((total - fails)) passed, $fails failed"
[[ $fails -eq 0 ]]
