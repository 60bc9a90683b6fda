#!/usr/bin/env bash
# The GPU check, as one script for a borrowed GPU machine (no network there):
#   1. bench/gpu_check.py: transformers generation on CUDA (tokens/s, log-prob agreement),
#      GRPO steps and weight sync on a ~100M model built in code; the vLLM rows run only
#      where vllm is importable;
#   2. the real controller on the GPU (`spotrl run` through examples/demo.py): the tiny job
#      and the ~100M job, each SIGTERMed part-way (barrier cut), resumed and finished;
#   3. bench/bench_numerics.py: one GRPO step of random policies in Qwen2.5-0.5B's and 1.5B's
#      shapes (8 rows of 128 + up to 384 tokens, micro-batches of 8 rows / 4096 tokens): bf16
#      compute over float32 masters against the step as it was (bf16 weights, whole-vocabulary
#      logits): peak GPU memory and step time.
# Prepare here with e2e/gpu/prepare.sh (wheels the machine lacks, in .gpu/); run there with
#   bash e2e/gpu/check.sh            (writes results under $OUT, or ./.out/gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-.out/gpu}
mkdir -p "$out"
site=/tmp/spotrl-site
if [[ -d .gpu ]]; then
  mkdir -p "$site"
  [[ -f .gpu/ray-trim.tar.xz ]] && tar -xJf .gpu/ray-trim.tar.xz -C "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/*.whl 2>&1 | tail -2
  export PYTHONPATH=$site:$PWD/runtime:$PWD/operator
else
  export PYTHONPATH=$PWD/runtime:$PWD/operator:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled SPOTRL_CACHE=/tmp/spotrl-cache
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)') 2>&1 | tee "$out/env.txt"

t0=$SECONDS
timeout 150 python3 bench/gpu_check.py --out "$out/gpu_check.json" --steps 3 >"$out/gpu_check.log" 2>&1
echo "gpu_check rc=$? in $((SECONDS - t0)) s" | tee -a "$out/env.txt"

for job in examples/tiny-cpu.yaml e2e/gpu/random-100m.yaml; do
  name=$(basename "$job" .yaml)
  t0=$SECONDS
  timeout 180 python3 examples/demo.py --job "$job" --out "/tmp/demo-$name" >"$out/demo-$name.log" 2>&1
  echo "demo $name rc=$? in $((SECONDS - t0)) s" | tee -a "$out/env.txt"
  cp "/tmp/demo-$name/second.json" "$out/demo-$name-second.json" 2>/dev/null
done
cp /tmp/demo-tiny-cpu/reward.png "$out/" 2>/dev/null

t0=$SECONDS
timeout 300 python3 bench/bench_numerics.py --only step --device cuda --policies 0.5b,1.5b \
  --variants "before bf16,after bf16,after fp32" --out "$out/numerics.json" >"$out/numerics.log" 2>&1
echo "bench_numerics rc=$? in $((SECONDS - t0)) s" | tee -a "$out/env.txt"
cat "$out/numerics.log"
tail -n 25 "$out"/demo-*.log
exit 0
