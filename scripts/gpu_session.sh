#!/usr/bin/env bash
# The GPU benchmark matrix, in parts that each fit one 10-minute call on the GPU machine.
# Every result lands in $OUT (CSV + Markdown), to be committed under benchmarks/ and docs/.
#   bash scripts/gpu_session.sh 1    # memtrain run: 1.1B offload, 7B LoRA; plan accuracy (1.1B); adaptive batch
#   bash scripts/gpu_session.sh 2    # plan accuracy (3B, 7B); checkpoint sweep 7B LoRA
#   bash scripts/gpu_session.sh sweep  # checkpoint sweep 1.1B
#   bash scripts/gpu_session.sh speed  # memtrain vs HF Trainer + DeepSpeed: 7B LoRA, 1.1B optimizer offload
#   bash scripts/gpu_session.sh speed2  # after the accumulation-boundary fix: 1.1B offload vs HF; larger micro-batches; 13B QLoRA
#   bash scripts/gpu_session.sh speed3  # 7B full fine-tune vs HF, pinned and unpinned (session 4)
#   bash scripts/gpu_session.sh speed4  # memtrain-only levers: expandable segments, micro-batch 16, checkpointing auto
#   bash scripts/gpu_session.sh speed5  # 7B LoRA micro-batch 8 + checkpointing auto; 3B ZeRO-3 with both auto
#   bash scripts/gpu_session.sh speed6  # not run yet: 7B LoRA under ZeRO-0, and HF at micro-batch 1
#   bash scripts/gpu_session.sh heldout # 1.1B NVMe and QLoRA accuracy cases (session 4)
#   bash scripts/gpu_session.sh final   # lean LoRA dropout accuracy rows + 1.1B NVMe (ran, session 4); its vs-HF step not run yet
#   bash scripts/gpu_session.sh profile # 7B LoRA: where a step goes (torch.profiler summaries, allocator retries) (session 5)
#   bash scripts/gpu_session.sh compile # 7B LoRA with compiled decoder layers (train.compile) vs HF (session 5)
#   bash scripts/gpu_session.sh equal3b # 3B ZeRO-3 offload vs HF near HF's own peak (6.41 GiB): mb 4 and mb 8 (session 6)
#   bash scripts/gpu_session.sh torch211 # session 6: the checkpoint-hooks fix under torch 2.11; 7B LoRA every-2 again; NVMe segments
#   bash scripts/gpu_session.sh equal3b-chunk # 3B mb 8 with smaller loss chunks, to stay under HF's 6.41 GiB (session 6)
#   bash scripts/gpu_session.sh equal3b-live # 3B mb 8 keeping 3e8 instead of 1e9 parameters gathered (session 6)
#   bash scripts/gpu_session.sh segments2 # per-stream segments of 1.1B ZeRO-3 CPU and NVMe, 3B ZeRO-3 CPU, init included (session 7)
#   bash scripts/gpu_session.sh streams  # held-out NVMe micro-batch 4 row (session 7)
#   bash scripts/gpu_session.sh prefetch # 3B at equal memory again, and with a prefetch bucket of most of a layer (session 8)
#   bash scripts/gpu_session.sh peaks    # session 8: what is live at the training peak, 1.1B ZeRO-3 CPU mb 2/4 and NVMe mb 4
#   bash scripts/gpu_session.sh heldout8 # session 8: three ZeRO-3 accuracy rows predicted before they ran
#   bash scripts/gpu_session.sh final8   # session 8, one call: the two ZeRO-3 CPU held-out rows, then 3B equal memory again
#   bash scripts/gpu_session.sh accuracy  # the whole plan-accuracy matrix, runs side by side within host RAM
#   bash scripts/gpu_session.sh families9 # session 9: held-out accuracy rows (Qwen2.5, Mistral, Gemma-2 LoRA; Phi-3-mini full; 7B chat packed)
#   bash scripts/gpu_session.sh full9     # session 9: Qwen2.5-7B and Mistral-7B full fine-tunes (ZeRO-3, CPU, unpinned), held out
#   bash scripts/gpu_session.sh vsfam9    # session 9: Qwen2.5-7B and Mistral-7B LoRA, memtrain vs HF Trainer + PEFT + DeepSpeed
#   bash scripts/gpu_session.sh run10a    # session 10, one call: 7B LoRA and 7B chat LoRA vs HF and HF + Liger; start-up rows
#   bash scripts/gpu_session.sh fam10     # session 10: held out Qwen3-8B full fine-tune and 7B DoRA; Gemma-2-9B LoRA vs HF
#   bash scripts/gpu_session.sh speed10   # issue 23: start-up phases (fresh, then warm); 7B LoRA memtrain default vs HF eager vs HF + Liger
#   bash scripts/gpu_session.sh speed10b  # issue 23, if time is left: start-up of the other shipped recipes (warm); memtrain without Liger
#   bash scripts/gpu_session.sh chat10    # session 10: 7B LoRA chat SFT packed at seq 2048 (the bundled chat data), memtrain vs HF
#                                         # Trainer on the same templated, masked, packed rows in the same order (~3 min)
#   bash scripts/gpu_session.sh host11    # session 11, issue 26: the 7B full fine-tune on a 64 GiB host (partial offload), its
#                                         # tokens/s and host RSS; then its two held-out plan-accuracy rows
#   bash scripts/gpu_session.sh phi11     # session 11, issue 22: Phi-3-mini LoRA vs HF Trainer + PEFT, eager and with Liger
#                                         # (all linear layers: Phi-3 fuses qkv_proj and gate_up_proj)
#   bash scripts/gpu_session.sh ongpu12   # session 12: 3B ZeRO-3 with parameters on the GPU, whole and with ratio 0.9 (held out)
#   bash scripts/gpu_session.sh host12    # session 12: the 64 GiB-host recipe at the micro-batch its plan now picks (4): tokens/s,
#                                         # peaks and host RSS (its held-out plan row is filled from this run's peaks)
#   bash scripts/gpu_session.sh inbwd13   # session 13, issue 26: the 7B full fine-tune with paged 8-bit AdamW stepped in backward
#                                         # (recipes/llama2-7b-full-32gb-host.yaml), mb 8 and 16, beside a process holding all
#                                         # but 24 GiB of the card; tokens/s, peaks, machine-wide host memory; then the 64 GiB-host
#                                         # recipe the same way, for the side-by-side
#   bash scripts/gpu_session.sh side13    # session 13, issue 26: the 32 GiB- and 64 GiB-host recipes as shipped, one after the
#                                         # other in one call, each beside hold_gpu_memory.py (the side-by-side row)
#   bash scripts/gpu_session.sh conv13    # session 13, issue 26: convergence of bf16 / 8-bit / in-backward against fp32 AdamW
#                                         # on the 1.1B shape (scripts/convergence.py, benchmarks/convergence.csv)
#   bash scripts/gpu_session.sh ckpt13    # session 13, issue 26: the 32 GiB-host recipe stopped after 2 steps (checkpoint), then
#                                         # resumed to its 3rd and exported, beside the holder and the host sampler
#   bash scripts/gpu_session.sh speed14   # session 14, issue 23, one call: 7B LoRA with compiled layers (with and without Liger's
#                                         # kernels) vs HF eager vs HF + Liger; its start-up fresh (empty op, Triton and
#                                         # inductor caches) and then warm
#   bash scripts/gpu_session.sh speed14b  # session 14, issue 23: memtrain's new default (compiled layers, Liger's loss) on
#                                         # the 7B LoRA and chat recipes vs HF eager and HF + Liger; warm start-up
#   bash scripts/gpu_session.sh qlora14   # session 14: the error that stops QLoRA with compiled layers
#   bash scripts/gpu_session.sh speed14c  # session 14, issue 23: compiled or not on QLoRA, Mistral-7B and Qwen2.5-7B LoRA
#   bash scripts/gpu_session.sh speed19a  # session 19, issue 23 (not run yet): the 1.1B recipe as shipped (micro-batch auto) vs
#                                         # HF eager and HF + Liger at micro-batch 4; offloaded optimizer or not, one invocation
#   bash scripts/gpu_session.sh speed19b  # session 19, issue 23 (not run yet): the 3B recipe as shipped vs HF eager; its
#                                         # held-out plan-accuracy row (micro-batch 16)
#   bash scripts/gpu_session.sh speed21   # session 21, issue 23: 7B LoRA as shipped, then checkpointing auto, ZeRO-0,
#                                         # micro-batch auto, each vs HF eager and HF + Liger in one invocation
#   bash scripts/gpu_session.sh startup15 # session 15, issue 23: where the offload recipes' start goes: import times, pinning
#                                         # speed per allocator setting, cProfile of a warm 1.1B and 3B start; then the
#                                         # Mistral-7B ZeRO-3 accuracy row again (issue 22)
#   bash scripts/gpu_session.sh startup15b # session 15, issue 23: start-up after parallel pinning and the background CPU Adam
#                                         # load: 1.1B fresh, then warm 1.1B, 3B (and 3B with serial pinning), QLoRA, 7B full
#   bash scripts/gpu_session.sh startup15c # session 15, issue 23: whether Python keeps bytecode there, import time; warm 1.1B
#                                         # and 3B start-up (each run twice), 3B with serial pinning
#   bash scripts/gpu_session.sh heldout15 # ran in session 18: the Llama-7B ZeRO-3 row unpinned (predicted 5.27 GiB in session 15),
#                                         # does pinning change the GPU's reserved bytes (issue 22's Mistral row, +6.1 %)?
#   bash scripts/gpu_session.sh startup16a # ran in session 18, issue 23: warm start-up (bytecode kept) of the shipped LoRA recipes:
#                                         # 7B LoRA, 7B and 13B QLoRA, each run twice (the second is the warm row)
#   bash scripts/gpu_session.sh startup16b # ran in session 18, issue 23: warm start-up of the shipped 7B full fine-tunes (32 / 64 GiB
#                                         # hosts, ZeRO-3 offload on one GPU), after one run that fills the caches
#   bash scripts/gpu_session.sh prepare16  # ran in session 18, issue 23: the 1.1B offload recipe's first start on empty caches,
#                                         # as it comes and after `memtrain prepare` (DeepSpeed's CPU Adam built ahead)
#   bash scripts/gpu_session.sh cpuadam16  # ran in session 18 (its torch rows again in cpuadam16b), issue 23: offload.cpu_adam=torch (PyTorch's fused AdamW, nothing to
#                                         # build) against DeepSpeed's CPU Adam: step time on 16 cores, the 1.1B and 3B
#                                         # offload recipes' tokens/s, and a fresh start with nothing to build
#   bash scripts/gpu_session.sh cpuadam16b # session 18: cpuadam16's tokens step again, and the 3B recipe with either CPU Adam
#   bash scripts/gpu_session.sh startup18  # session 18: the 7B ZeRO-3 recipes' warm rows, 3B warm with either CPU Adam, 1.1B
#                                          # tokens/s with either in one invocation
#   bash scripts/gpu_session.sh segments18 # ran in session 18: per-stream segments of the Mistral-7B ZeRO-3 row
set -u
part=${1:?part}
OUT=${OUT:-/tmp/memtrain-out}
mkdir -p "$OUT"
budget=${BUDGET_S:-570}
left() { echo $((budget - SECONDS)); }
step() {  # step NAME MAX_SECONDS COMMAND...: run when enough time is left, never past the budget
  local name=$1 max=$2; shift 2
  local allowed=$(( $(left) < max ? $(left) : max ))
  if (( allowed < 30 )); then echo "== skip $name (${allowed}s left)"; return; fi
  echo "== $name (up to ${allowed}s) at ${SECONDS}s"
  timeout "$allowed" "$@" 2>&1 | grep -v -E "^\[20..-..-.. .*(INFO|WARNING)" | tail -n 40
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# The GPU machine's image keeps no bytecode beside PyTorch and transformers and did not write any, so every Python
# start there compiled ~5,000 modules again (11 s of each start, cProfile in session 15); pip writes the bytecode at
# install on a user's machine. Bytecode is written, to a folder of its own (runs before session 15 paid that cost).
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
unset PYTHONDONTWRITEBYTECODE
quiet="train.eval_every=1000 train.save_every=1000 schedule.warmup_steps=2"
held() {  # held NAME MAX_SECONDS COMMAND...: a step run beside hold_gpu_memory.py (the card physically 24 GiB) and a
  # machine-wide host memory sampler ($OUT/host-NAME.json), both stopped after it
  local name=$1; shift
  python3 scripts/hold_gpu_memory.py > "$OUT/hold-$name.txt" 2>&1 &
  local holder=$!
  for _ in $(seq 60); do grep -q holding "$OUT/hold-$name.txt" && break; sleep 1; done
  cat "$OUT/hold-$name.txt"
  python3 scripts/sample_host_memory.py "$OUT/host-$name.json" &
  local sampler=$!
  step "$name" "$@"
  kill $sampler $holder; wait $sampler $holder 2>/dev/null
  cat "$OUT/host-$name.json"; echo
}
offload_startup15() {  # MAX_S RUN_TIMEOUT_S SERIAL_MAX_S SERIAL_TIMEOUT_S: warm start-up of the two offload recipes, each
  # run twice (the first fills the default Triton cache for its shapes, the second is the warm row), then 3B with serial pinning
  step warm-offload "$1" python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 \
    --timeout "$2" --label "session 15" --recipe recipes/tinyllama-1.1b-full-offload-24gb.yaml \
    --recipe recipes/tinyllama-1.1b-full-offload-24gb.yaml --recipe recipes/openllama-3b-full-offload-24gb.yaml \
    --recipe recipes/openllama-3b-full-offload-24gb.yaml
  PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:False step serial-pinning "$3" python3 scripts/bench_startup.py \
    --out "$OUT/startup.csv" --machine-state warm --steps 1 --timeout "$4" --label "session 15, serial pinning" \
    --recipe recipes/openllama-3b-full-offload-24gb.yaml
}
case $part in
cpuadam16)  # ~9 min
  cp benchmarks/cpu_adam.csv "$OUT/cpu_adam.csv" 2>/dev/null
  step cpu-adam-step 120 python3 scripts/bench_cpu_adam.py --millions 300 1100 --steps 5 --out "$OUT/cpu_adam.csv"
  cp benchmarks/runs.csv "$OUT/runs.csv"
  step tokens 300 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 140 --warmup-steps 2 \
    --title "memtrain run on the GPU machine (24 GiB cap)" \
    --case "1.1b-full-opt-offload (session 16, DeepSpeed's CPU Adam)=recipes/tinyllama-1.1b-full-offload-24gb.yaml train.steps=8 $quiet" \
    --case "1.1b-full-opt-offload (session 16, offload.cpu_adam torch)=recipes/tinyllama-1.1b-full-offload-24gb.yaml train.steps=8 $quiet offload.cpu_adam=torch" \
    --case "3b-full-offload (session 16, offload.cpu_adam torch)=recipes/openllama-3b-full-offload-24gb.yaml train.steps=5 $quiet offload.cpu_adam=torch"
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step fresh-torch-adam 100 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state fresh --steps 1 \
    --timeout 90 --label "session 16, offload.cpu_adam=torch" \
    --recipe "recipes/tinyllama-1.1b-full-offload-24gb.yaml offload.cpu_adam=torch"
  ;;
segments18)  # session 18, the device time left (~4 min): per-stream segments of the Mistral-7B ZeRO-3 row (+6.1 %, the
  # one family row outside 5 %), to set against the planner's per-stream terms
  step segments-mistral 230 python3 scripts/memory_segments.py recipes/llama2-7b-full-offload-2x24gb.yaml hardware.gpus=1 \
    model.preset=mistral-7b-v0.3 offload.pin_memory=false batch.micro_batch=2 batch.global_batch=4 data.seq_len=1024 \
    hardware.gpu=rtx3090 hardware.cap_memory=true train.steps=2 schedule.warmup_steps=1 $quiet train.log_every=1 \
    train.output_dir=/tmp/seg-mistral --out "$OUT/segments-mistral-7b-zero3-cpu.json"
  ;;
speed19a)  # session 19, issue 23, ~8 min: the 1.1B offload recipe as shipped (batch.micro_batch auto: 16) against HF
  # eager and HF + Liger at the micro-batch a user writes (4, accumulation 4; same global batch 16), then the same recipe
  # with and without the optimizer offloaded, each at the micro-batch its plan picks, in one invocation (goal >= 0.8x)
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  cp benchmarks/runs.csv "$OUT/runs.csv"
  tiny=recipes/tinyllama-1.1b-full-offload-24gb.yaml
  step vs-hf 300 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 140 \
    --baseline hf,hf-liger \
    --case "1.1b-full-opt-offload (session 19, memtrain as shipped: micro-batch auto)=$tiny batch.micro_batch=4 schedule.warmup_steps=2 :: batch.micro_batch=auto"
  step offload-or-not 200 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 95 --warmup-steps 2 \
    --title "memtrain run on the GPU machine (24 GiB cap)" \
    --case "1.1b-full-opt-offload (session 19, as shipped)=$tiny train.steps=8 $quiet" \
    --case "1.1b-full-no-offload (session 19, micro-batch auto)=$tiny train.steps=8 $quiet offload.optimizer=none"
  ;;
speed19b)  # session 19, issue 23, ~9 min: the 3B offload recipe as shipped (micro-batch auto: 16, every layer) against HF
  # eager at micro-batch 4 (same global batch 16); then its held-out plan-accuracy row (predicted in bed06ab: 9.51 GiB)
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  step vs-hf 330 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 6 --warmup 2 --timeout 160 \
    --case "3b-zero3-opt-params-cpu (session 19, memtrain as shipped: micro-batch auto)=recipes/openllama-3b-full-offload-24gb.yaml batch.micro_batch=4 schedule.warmup_steps=2 :: batch.micro_batch=auto"
  step accuracy 200 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 190 \
    --only 3b-zero3-cpu-every-mb16-s1024
  ;;
speed21)  # session 21, issue 23, ~7 min (the device time left): 7B LoRA as shipped against HF eager and HF + Liger in one
  # invocation (one HF run each), then the levers not measured with compiled layers, most promising first: checkpointing
  # auto (the plan keeps 8 of 32 layers, 22.25 GiB predicted), ZeRO-0 (no per-parameter reduce hooks on the 448 adapter
  # tensors; +14 ms per micro-batch on the CPU, benchmarks/micro_batch_overhead.csv), the planner's micro-batch (8)
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  lora="recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2"
  step vs-hf 560 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 110 \
    --baseline hf,hf-liger \
    --case "7b-lora-mb4x1024 (session 21, memtrain as shipped)=$lora" \
    --case "7b-lora-mb4x1024 (session 21, memtrain checkpointing auto)=$lora :: checkpointing.strategy=auto" \
    --case "7b-lora-mb4x1024 (session 21, memtrain ZeRO-0)=$lora :: offload.zero_stage=0" \
    --case "7b-lora-mb4x1024 (session 21, memtrain micro-batch auto)=$lora :: batch.micro_batch=auto"
  ;;
startup18)  # session 18, ~9 min: the warm rows startup16b ran once (each recipe's second run is its warm row), the 3B
  # offload recipe warm with either CPU Adam, and the 1.1B recipe's tokens/s with either CPU Adam in one invocation
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step warm-full 200 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 --timeout 90 \
    --label "session 18" --recipe recipes/llama2-7b-full-64gb-host.yaml --recipe recipes/llama2-7b-full-64gb-host.yaml \
    --recipe "recipes/llama2-7b-full-offload-2x24gb.yaml hardware.gpus=1"
  step warm-3b 150 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 --timeout 70 \
    --label "session 18" --recipe recipes/openllama-3b-full-offload-24gb.yaml \
    --recipe "recipes/openllama-3b-full-offload-24gb.yaml offload.cpu_adam=torch"
  cp benchmarks/runs.csv "$OUT/runs.csv"
  step tokens 150 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 70 --warmup-steps 2 \
    --title "memtrain run on the GPU machine (24 GiB cap)" \
    --case "1.1b-full-opt-offload (session 18, DeepSpeed's CPU Adam)=recipes/tinyllama-1.1b-full-offload-24gb.yaml train.steps=8 $quiet" \
    --case "1.1b-full-opt-offload (session 18, offload.cpu_adam torch)=recipes/tinyllama-1.1b-full-offload-24gb.yaml train.steps=8 $quiet offload.cpu_adam=torch"
  ;;
cpuadam16b)  # session 18: the tokens step of cpuadam16 again (its labels held '=', which the case parser splits on), with
  # the 3B recipe on DeepSpeed's CPU Adam beside it
  cp benchmarks/runs.csv "$OUT/runs.csv"
  step tokens 330 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 140 --warmup-steps 2 \
    --title "memtrain run on the GPU machine (24 GiB cap)" \
    --case "1.1b-full-opt-offload (session 18, offload.cpu_adam torch)=recipes/tinyllama-1.1b-full-offload-24gb.yaml train.steps=8 $quiet offload.cpu_adam=torch" \
    --case "3b-full-offload (session 18, DeepSpeed's CPU Adam)=recipes/openllama-3b-full-offload-24gb.yaml train.steps=5 $quiet" \
    --case "3b-full-offload (session 18, offload.cpu_adam torch)=recipes/openllama-3b-full-offload-24gb.yaml train.steps=5 $quiet offload.cpu_adam=torch"
  ;;
prepare16)  # ~5 min: two fresh starts of ~60-90 s, the second after prepare's build (~40 s)
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step fresh 150 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state fresh --steps 1 --timeout 140 \
    --label "session 16" --recipe recipes/tinyllama-1.1b-full-offload-24gb.yaml
  step fresh-prepared 200 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state fresh --steps 1 \
    --timeout 120 --prepare --label "session 16, after memtrain prepare" --recipe recipes/tinyllama-1.1b-full-offload-24gb.yaml
  ;;
startup16a)  # ~6 min: 6 runs of ~25-40 s to the first step, plus one evaluation batch and teardown each
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step warm-lora 540 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 --timeout 85 \
    --label "session 16" --recipe recipes/llama2-7b-lora-24gb.yaml --recipe recipes/llama2-7b-lora-24gb.yaml \
    --recipe recipes/llama2-7b-qlora-16gb.yaml --recipe recipes/llama2-7b-qlora-16gb.yaml \
    --recipe recipes/llama2-13b-qlora-24gb.yaml --recipe recipes/llama2-13b-qlora-24gb.yaml
  ;;
startup16b)  # ~9 min; the CPU Adam op is built first, outside the rows
  step cpu-adam 90 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step warm-full 470 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 --timeout 110 \
    --label "session 16" --recipe recipes/llama2-7b-full-32gb-host.yaml --recipe recipes/llama2-7b-full-32gb-host.yaml \
    --recipe recipes/llama2-7b-full-64gb-host.yaml --recipe "recipes/llama2-7b-full-offload-2x24gb.yaml hardware.gpus=1"
  # not recipes/llama2-7b-nvme-24gb.yaml: its plan puts 87.9 GiB on NVMe, the GPU machine has a 64 GB disk
  ;;
heldout15)
  cp benchmarks/plan_accuracy.csv "$OUT/plan_accuracy.csv"  # the predictions committed before this run are replaced
  step plan-unpinned 300 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 280 --parallel 1 \
    --only 7b-zero3-cpu-bf16master-unpinned
  ;;
startup15c)
  python3 -c "import sys; print('dont_write_bytecode:', sys.flags.dont_write_bytecode)"
  for i in 1 2 3; do /usr/bin/time -f "import memtrain.commands.run: %e s" python3 -c "import memtrain.commands.run"; done
  step cpu-adam 90 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  offload_startup15 260 80 90 85
  ;;
startup15b)
  python3 -c "import os, glob, torch; d = os.path.dirname(torch.__file__); print('torch dir writable:', os.access(d, os.W_OK), \
    'bytecode files beside it:', len(glob.glob(d + '/**/__pycache__/*.pyc', recursive=True)))"
  step bytecode 90 python3 -c "import memtrain.commands.run, deepspeed, peft, liger_kernel.transformers"  # pip's install-time compile
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step fresh 120 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state fresh --steps 1 --timeout 110 \
    --label "session 15" --recipe recipes/tinyllama-1.1b-full-offload-24gb.yaml
  step cpu-adam 90 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
  offload_startup15 200 90 80 75
  step warm-other 200 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 --timeout 90 \
    --label "session 15" --recipe recipes/llama2-7b-qlora-16gb.yaml --recipe recipes/llama2-7b-qlora-16gb.yaml \
    --recipe recipes/llama2-7b-full-32gb-host.yaml
  ;;
startup15)
  python3 -X importtime -c "import memtrain.commands.run" 2>/dev/null  # the first import writes the bytecode
  python3 -X importtime -c "import memtrain.commands.run" 2> "$OUT/importtime.txt"
  sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -n 25
  step pinned 100 python3 scripts/bench_pinned.py --gib 4 --out "$OUT/pinned.csv"
  step cpu-adam 120 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
  for r in tinyllama-1.1b-full-offload-24gb openllama-3b-full-offload-24gb; do
    step "profile-$r" 150 bash -c "python3 -m cProfile -o $OUT/$r.pstats -m memtrain run recipes/$r.yaml $quiet \
      train.output_dir=/tmp/s15-$r --max-steps 1 --no-save > $OUT/$r.log 2>&1; echo rc=\$?; \
      grep -h startup /tmp/s15-$r/metrics.jsonl | tee $OUT/$r-startup.json; \
      python3 -c 'import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats(\"cumulative\").print_stats(80)' \
      $OUT/$r.pstats > $OUT/$r-cumulative.txt; python3 -c 'import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats(\"tottime\").print_stats(40)' \
      $OUT/$r.pstats > $OUT/$r-tottime.txt"
  done
  cp benchmarks/plan_accuracy.csv "$OUT/plan_accuracy.csv"  # the predictions committed before this run are replaced
  step plan-mistral-again 300 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 280 --parallel 1 \
    --only mistral-7b-zero3-cpu-unpinned-mb2-s1024-again
  ;;
ckpt13)
  # ran once in session 13, before the resume fix: the save took 27.4 GiB of host memory machine-wide and the resume
  # ran out of GPU memory loading the checkpoint (DeepSpeed put the saved weights back on the card); not run since
  common="recipes/llama2-7b-full-32gb-host.yaml $quiet train.steps=3 train.save_every=2 train.output_dir=/tmp/ckpt13"
  held ckpt 380 bash -c "python3 -m memtrain run $common --max-steps 2; echo rc=\$?; du -sh /tmp/ckpt13/checkpoints/*; \
    python3 -m memtrain run $common; echo rc=\$?; du -sh /tmp/ckpt13/final; \
    grep -h -E '\"(train|checkpoint|startup)\"|resume' /tmp/ckpt13/metrics.jsonl | cut -c1-400"
  ;;
side13)
  cp benchmarks/runs.csv "$OUT/runs.csv"
  title="memtrain run on the GPU machine (24 GiB cap)"
  held side-32gb 200 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 190 --warmup-steps 2 --title "$title" \
    --case "7b-full-32gb-host (as shipped: paged 8-bit AdamW in backward, mb 16; card held to 24 GiB; side by side)=recipes/llama2-7b-full-32gb-host.yaml train.steps=8 $quiet"
  held side-64gb 300 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 290 --warmup-steps 2 --title "$title" \
    --case "7b-full-64gb-host (as shipped; card held to 24 GiB; side by side)=recipes/llama2-7b-full-64gb-host.yaml train.steps=5 $quiet"
  ;;
conv13)
  touch benchmarks/convergence.csv; cp benchmarks/convergence.csv "$OUT/convergence.csv"
  step conv-1.1b 560 python3 scripts/convergence.py --out "$OUT/convergence.csv" --label gpu-1.1b --timeout 150 \
    --recipe recipes/tinyllama-1.1b-full-offload-24gb.yaml --set train.steps=100 train.eval_every=100 \
    schedule.warmup_steps=10 optimizer.lr=3.0e-4 batch.global_batch=4 batch.micro_batch=4 data.seq_len=1024
  ;;
inbwd13)
  cp benchmarks/runs.csv "$OUT/runs.csv"
  title="memtrain run on the GPU machine (24 GiB cap)"
  held inbwd-mb8 200 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 190 --warmup-steps 2 --title "$title" \
    --case "7b-full-32gb-host (paged 8-bit AdamW in backward, mb 8, card held to 24 GiB)=recipes/llama2-7b-full-32gb-host.yaml train.steps=8 $quiet"
  held inbwd-mb16 200 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 190 --warmup-steps 2 --title "$title" \
    --case "7b-full-32gb-host (paged 8-bit AdamW in backward, mb 16, card held to 24 GiB)=recipes/llama2-7b-full-32gb-host.yaml batch.global_batch=16 batch.micro_batch=16 train.steps=6 $quiet"
  [ "${SKIP_HOST64:-0}" = 1 ] || held host64 260 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 250 --warmup-steps 2 --title "$title" \
    --case "7b-full-64gb-host (as shipped, card held to 24 GiB)=recipes/llama2-7b-full-64gb-host.yaml train.steps=4 $quiet"
  ;;
host11)
  cp benchmarks/runs.csv "$OUT/runs.csv"
  step host64 330 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 320 --warmup-steps 2 \
    --title "memtrain run on the GPU machine (24 GiB cap)" \
    --case "7b-full-64gb-host (parameters on the CPU, partial offload 0.7, micro-batch auto)=recipes/llama2-7b-full-64gb-host.yaml offload.params=cpu offload.ratio=0.7 train.steps=7 $quiet"
  # run as a second call in session 11 (bench_run's timeout cut it at 2 steps): the recipe's own settings since then
  step host64-gpu-params 280 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 270 --warmup-steps 2 \
    --title "memtrain run on the GPU machine (24 GiB cap)" \
    --case "7b-full-64gb-host (parameters on the GPU, partial offload 0.9, micro-batch auto)=recipes/llama2-7b-full-64gb-host.yaml offload.params=none offload.ratio=0.9 train.steps=6 $quiet"
  cp benchmarks/plan_accuracy.csv "$OUT/plan_accuracy.csv"  # the predictions committed before this run are replaced
  step plan-host64 400 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 200 --parallel 1 \
    --only ratio0.7,ratio0.9
  ;;
host12)
  cp benchmarks/runs.csv "$OUT/runs.csv"
  step host64-mb4 300 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 290 --warmup-steps 2 \
    --title "memtrain run on the GPU machine (24 GiB cap)" \
    --case "7b-full-64gb-host (parameters on the GPU, partial offload 0.9, micro-batch auto: 4)=recipes/llama2-7b-full-64gb-host.yaml train.steps=4 $quiet"
  ;;
ongpu12)
  cp benchmarks/plan_accuracy.csv "$OUT/plan_accuracy.csv"  # the predictions committed before this run are replaced
  step plan-ongpu 500 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 240 --parallel 1 \
    --only params-gpu
  ;;
phi11)
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  step vs-hf-phi3 400 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 150 \
    --baseline hf,hf-liger --case "phi3-mini-lora-mb4x1024 (all linear layers)=recipes/llama2-7b-lora-24gb.yaml model.preset=phi3-mini model.lora.target_modules=all-linear schedule.warmup_steps=2"
  ;;
families9)
  cp benchmarks/plan_accuracy.csv "$OUT/plan_accuracy.csv"  # the predictions committed before this run are replaced
  step plan-families 400 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 330 --parallel 3 \
    --host-budget-gib 110 --only qwen2.5,mistral-7b,gemma2,phi3,chat-packed
  ;;
full9)
  cp benchmarks/plan_accuracy.csv "$OUT/plan_accuracy.csv"  # the predictions committed before this run are replaced
  step plan-full 560 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 280 --parallel 1 \
    --only zero3-cpu-unpinned
  ;;
fam10)
  cp benchmarks/plan_accuracy.csv "$OUT/plan_accuracy.csv"  # the predictions committed before this run are replaced
  step plan-fam 330 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 300 --parallel 1 \
    --only qwen3-8b-zero3,7b-dora
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  step vs-hf-gemma 240 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 110 \
    --case "gemma2-9b-lora-mb1x1024=recipes/llama2-7b-lora-24gb.yaml model.preset=gemma2-9b batch.micro_batch=1 batch.global_batch=4 schedule.warmup_steps=2"
  ;;
run10d)  # held-out accuracy of the Liger path (predicted and committed first), then start-up on emptied op caches
  cp benchmarks/plan_accuracy.csv "$OUT/plan_accuracy.csv"
  step plan-liger 200 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 120 --parallel 1 --only liger
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step startup 200 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state fresh --steps 1 --timeout 120 \
    --recipe recipes/tinyllama-1.1b-full-offload-24gb.yaml --recipe recipes/llama2-7b-lora-24gb.yaml
  ;;
run10c)  # the Gemma-2 row fam10 lost to the recipe's 10 warm-up steps, memtrain without Liger beside HF, start-up rows
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  step vs-hf-gemma 200 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 100 \
    --baseline hf,hf-liger \
    --case "gemma2-9b-lora-mb1x1024=recipes/llama2-7b-lora-24gb.yaml model.preset=gemma2-9b batch.micro_batch=1 batch.global_batch=4 schedule.warmup_steps=2"
  step vs-hf-eager 120 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 100 \
    --case "7b-lora-mb4x1024 (session 10, memtrain model.kernels none)=recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2 :: model.kernels=none"
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step startup 150 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 --timeout 90 \
    --recipe recipes/openllama-3b-full-offload-24gb.yaml --recipe recipes/llama2-7b-qlora-16gb.yaml
  ;;
vsfam9)
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  step vs-hf 570 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 10 --warmup 3 --timeout 140 \
    --case "qwen2.5-7b-lora-mb4x1024=recipes/llama2-7b-lora-24gb.yaml model.preset=qwen2.5-7b" \
    --case "mistral-7b-lora-mb4x1024=recipes/llama2-7b-lora-24gb.yaml model.preset=mistral-7b-v0.3"
  ;;
speed10)  # under 8 minutes: the two steps are capped at 235 + 235 s (estimates in the comments)
  # (b) first, on empty op caches: 1.1B ZeRO-2 offload builds DeepSpeed's CPU Adam (~45 s) and reaches its first step in
  # ~80-130 s (issue 23); then, warm, 7B LoRA (~20-30 s, plus Liger's Triton JIT) and 3B ZeRO-3 offload (~50-60 s);
  # one step each, ~10 s teardown. A row is written as each run ends, so a cut-off keeps the rows before it.
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step startup 235 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state fresh --steps 1 --timeout 150 \
    --recipe recipes/tinyllama-1.1b-full-offload-24gb.yaml --recipe recipes/llama2-7b-lora-24gb.yaml \
    --recipe recipes/openllama-3b-full-offload-24gb.yaml
  # (a) 7B LoRA 4 x 1024 as shipped, 8 steps (warm-up 2, so the recipe's 10 warm-up steps are 2 on every side): each side
  # ~20-30 s to its first step + 8 x ~2.2 s (16,384 tokens at ~7,300 tokens/s) + teardown, ~55-65 s; three sides ~180 s
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  step vs-hf 235 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 100 \
    --baseline hf,hf-liger --case "7b-lora-mb4x1024 (session 10)=recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2"
  ;;
speed10b)  # the rest of issue 23's start-up table (warm), and memtrain without Liger at 7B LoRA
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step startup 330 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 --timeout 150 \
    --recipe recipes/llama2-7b-qlora-16gb.yaml --recipe recipes/llama2-13b-qlora-24gb.yaml \
    --recipe "recipes/llama2-7b-full-offload-2x24gb.yaml hardware.gpus=1" \
    --recipe recipes/llama2-7b-nvme-24gb.yaml
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  step vs-hf 200 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 100 \
    --case "7b-lora-mb4x1024 (session 10, memtrain model.kernels none)=recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2 :: model.kernels=none"
  ;;
speed14)  # one call, under 9.5 minutes (estimates: fresh start-up 90 s, vs-HF 4 runs 260 s, warm start-up 60 s)
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step startup-fresh 130 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state fresh --steps 1 \
    --timeout 120 --recipe "recipes/llama2-7b-lora-24gb.yaml train.compile=true"
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  step vs-hf 330 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 110 \
    --baseline hf,hf-liger \
    --case "7b-lora-mb4x1024 (session 14, compiled layers)=recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2 :: train.compile=true" \
    --case "7b-lora-mb4x1024 (session 14, compiled layers, model.kernels none)=recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2 :: train.compile=true model.kernels=none"
  step startup-warm 90 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 \
    --timeout 85 --recipe "recipes/llama2-7b-lora-24gb.yaml train.compile=true"
  ;;
speed14b)  # under 9.5 minutes: memtrain's new default (train.compile auto: compiled layers, Liger's loss only) on the 7B
  # LoRA recipe and the chat recipe (packed 2 x 2048), each against HF eager and HF + Liger; warm start-up between
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step vs-hf 230 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 110 \
    --baseline hf,hf-liger --case "7b-lora-mb4x1024 (session 14, memtrain default)=recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2"
  step startup-warm 70 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 \
    --timeout 65 --recipe "recipes/llama2-7b-lora-24gb.yaml"
  chat="recipes/llama2-7b-lora-24gb.yaml model.tokenizer=builtin:shakespeare-chat
        'data.train=[{path: \"builtin:chat\", type: chat}]' data.validation=null data.template=chatml data.packing=true
        batch.micro_batch=2 batch.global_batch=4 data.seq_len=2048 schedule.warmup_steps=2"
  step vs-hf-chat 250 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 110 \
    --baseline hf,hf-liger --case "7b-lora-chat-packed-every-mb2x2048 (session 14, memtrain default)=$chat"
  ;;
speed14c)  # under 9.5 minutes, memtrain alone: compiled layers or not on QLoRA and two other 7B families' LoRA
  step compiled-or-not 540 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 100 \
    --title "memtrain run on the GPU machine (24 GiB cap)" \
    --case "7b-qlora-nf4 (session 14, eager)=recipes/llama2-7b-qlora-16gb.yaml train.steps=8 $quiet train.compile=false" \
    --case "7b-qlora-nf4 (session 14, compiled layers)=recipes/llama2-7b-qlora-16gb.yaml train.steps=8 $quiet train.compile=true" \
    --case "mistral-7b-lora (session 14, eager)=recipes/llama2-7b-lora-24gb.yaml model.preset=mistral-7b-v0.3 train.steps=8 $quiet train.compile=false" \
    --case "mistral-7b-lora (session 14, compiled layers)=recipes/llama2-7b-lora-24gb.yaml model.preset=mistral-7b-v0.3 train.steps=8 $quiet train.compile=true" \
    --case "qwen2.5-7b-lora (session 14, eager)=recipes/llama2-7b-lora-24gb.yaml model.preset=qwen2.5-7b train.steps=8 $quiet train.compile=false" \
    --case "qwen2.5-7b-lora (session 14, compiled layers)=recipes/llama2-7b-lora-24gb.yaml model.preset=qwen2.5-7b train.steps=8 $quiet train.compile=true"
  ;;
qlora14)  # session 14: why compiled layers stop a QLoRA run (rc 1 in speed14c), the traceback's end
  step qlora-compiled 100 bash -c "python3 -m memtrain run recipes/llama2-7b-qlora-16gb.yaml train.steps=1 $quiet \
    train.compile=true train.output_dir=/tmp/qlora14 --no-save 2>&1 | grep -v -E 'triton_kernel_wrap|^.rank0.:W' | tail -n 25"
  ;;
run10a)  # one call, under 9.5 minutes: 7B LoRA memtrain default vs HF eager vs HF + Liger (the first run of memtrain's
  # Liger path, so first), then the chat recipe against both baselines, then start-up rows with what is left
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  step vs-hf 230 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 100 \
    --baseline hf,hf-liger --case "7b-lora-mb4x1024 (session 10)=recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2"
  chat="recipes/llama2-7b-lora-24gb.yaml model.lora.lean_dropout=false model.tokenizer=builtin:shakespeare-chat
        'data.train=[{path: \"builtin:chat\", type: chat}]' data.validation=null data.template=chatml data.packing=true
        batch.micro_batch=2 batch.global_batch=4 data.seq_len=2048 schedule.warmup_steps=2"
  step vs-hf-chat 230 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 100 \
    --baseline hf,hf-liger --case "7b-lora-chat-packed-every-mb2x2048=$chat"
  cp benchmarks/startup.csv "$OUT/startup.csv" 2>/dev/null
  step startup 200 python3 scripts/bench_startup.py --out "$OUT/startup.csv" --machine-state warm --steps 1 --timeout 90 \
    --recipe recipes/llama2-7b-lora-24gb.yaml --recipe recipes/tinyllama-1.1b-full-offload-24gb.yaml
  ;;
chat10)  # issue 21: the plan-accuracy case 7b-lora-chat-packed-every-mb2-s2048 as a vs-HF row; both sides train on
  # memtrain's rows (builtin:chat is .jsonl, read without datasets/pyarrow) with position_ids that restart per sample
  cp benchmarks/vs_hf.csv "$OUT/vs_hf.csv"
  chat="recipes/llama2-7b-lora-24gb.yaml model.lora.lean_dropout=false model.tokenizer=builtin:shakespeare-chat
        'data.train=[{path: \"builtin:chat\", type: chat}]' data.validation=null data.template=chatml data.packing=true
        batch.micro_batch=2 batch.global_batch=4 data.seq_len=2048 schedule.warmup_steps=2"
  step vs-hf 240 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 110 \
    --case "7b-lora-chat-packed-every-mb2x2048=$chat"
  ;;
1)
  step bench 330 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 200 --title "memtrain run on the GPU machine (24 GiB cap)" \
    --case "1.1b-full-opt-offload-mb4x1024=recipes/tinyllama-1.1b-full-offload-24gb.yaml train.steps=12 $quiet" \
    --case "7b-lora-mb4x1024=recipes/llama2-7b-lora-24gb.yaml train.steps=10 $quiet"
  step plan-1.1b 170 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 100 --calibrate \
    --only 1.1b-no-offload,1.1b-opt-cpu-every2,1.1b-lora,1.1b-opt-cpu-none
  step adaptive 200 python3 scripts/bench_run.py --out "$OUT/adaptive.csv" --timeout 150 --warmup-steps 0 \
    --title "Adaptive micro-batch on the GPU machine (24 GiB cap)" \
    --case "7b-lora-adaptive-from-mb16=recipes/llama2-7b-lora-24gb.yaml batch.policy=adaptive batch.micro_batch=16 batch.global_batch=32 checkpointing.strategy=none train.steps=8 $quiet" \
    --case "1.1b-full-adaptive-auto=recipes/tinyllama-1.1b-full-offload-24gb.yaml batch.policy=adaptive batch.micro_batch=auto batch.global_batch=32 train.steps=10 $quiet"
  ;;
2)
  step plan-3b-7b 300 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 150 \
    --only 3b-zero3,7b-lora-every-mb4,7b-zero3,7b-zero2
  step sweep-7b-lora 90 python3 scripts/checkpoint_sweep.py --preset llama2-7b --lora --micro-batch 4 --seq-len 1024 \
    --steps 3 --strategies none,every_1,every_2,selective --out "$OUT/checkpoint_sweep.csv"
  ;;
sweep)
  step sweep-1.1b 100 python3 scripts/checkpoint_sweep.py --preset tinyllama-1.1b --micro-batch 4 --seq-len 1024 \
    --steps 4 --out "$OUT/checkpoint_sweep.csv"
  ;;
speed)
  python3 -c "import torch; from memtrain.train.runtime.allocator import exact_pinned_supported as e; print('torch', torch.__version__, 'exact pinned sizes:', e())"
  step vs-hf 560 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 12 --warmup 3 --timeout 240 \
    --case "7b-lora-mb4x1024=recipes/llama2-7b-lora-24gb.yaml" \
    --case "1.1b-full-opt-offload-mb4x1024=recipes/tinyllama-1.1b-full-offload-24gb.yaml"
  ;;
speed2)
  step vs-hf 250 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 12 --warmup 3 --timeout 200 \
    --case "1.1b-full-opt-offload-mb4x1024=recipes/tinyllama-1.1b-full-offload-24gb.yaml"
  step runs 300 python3 scripts/bench_run.py --out "$OUT/runs.csv" --timeout 150 --title "memtrain run on the GPU machine (24 GiB cap)" \
    --case "1.1b-full-opt-offload-mb16x1024=recipes/tinyllama-1.1b-full-offload-24gb.yaml batch.micro_batch=16 train.steps=12 $quiet" \
    --case "13b-qlora-nf4-mb8x1024=recipes/llama2-13b-qlora-24gb.yaml train.steps=8 $quiet" \
    --case "1.1b-full-opt-offload-mb8x1024=recipes/tinyllama-1.1b-full-offload-24gb.yaml batch.micro_batch=8 train.steps=12 $quiet"
  ;;
speed3)  # the 7B full fine-tune goal (>= 1,077 tokens/s with host <= 90 GiB): HF at the recipe's micro-batch 2
  # against memtrain with the planner's micro-batch and checkpointing, pinned and unpinned host buffers
  full7b="recipes/llama2-7b-full-offload-2x24gb.yaml hardware.gpus=1 schedule.warmup_steps=2"
  step vs-hf 560 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 5 --warmup 1 --timeout 260 \
    --case "7b-full-zero3-offload-bf16master-mb2x1024 (memtrain micro-batch and checkpointing auto)=$full7b :: batch.micro_batch=auto checkpointing.strategy=auto" \
    --case "7b-full-zero3-offload-bf16master-mb2x1024 (memtrain micro-batch and checkpointing auto, unpinned)=$full7b :: batch.micro_batch=auto checkpointing.strategy=auto offload.pin_memory=false"
  ;;
speed4)  # planner-chosen levers (memtrain only, after "::"): expandable segments, larger micro-batch, checkpointing auto
  tiny=recipes/tinyllama-1.1b-full-offload-24gb.yaml lora=recipes/llama2-7b-lora-24gb.yaml
  step vs-hf 560 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 12 --warmup 3 --timeout 200 \
    --case "1.1b-full-opt-offload-mb4x1024 (memtrain mb16)=$tiny :: batch.micro_batch=16" \
    --case "7b-lora-mb4x1024 (memtrain mb1, checkpointing auto)=$lora :: batch.micro_batch=1 checkpointing.strategy=auto" \
    --case "7b-lora-mb4x1024 (memtrain mb2, checkpointing auto)=$lora :: batch.micro_batch=2 checkpointing.strategy=auto" \
    --case "1.1b-full-opt-offload-mb4x1024 (memtrain mb16, checkpointing auto)=$tiny :: batch.micro_batch=16 checkpointing.strategy=auto" \
    --case "7b-lora-mb4x1024 (memtrain checkpointing auto)=$lora :: checkpointing.strategy=auto"
  ;;
speed5)  # 7B LoRA at a planner-sized micro-batch 8; 3B ZeRO-3 offload with micro-batch and checkpointing auto
  step vs-hf 420 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 150 \
    --case "7b-lora-mb4x1024 (memtrain mb8, checkpointing auto)=recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2 :: batch.micro_batch=8 checkpointing.strategy=auto" \
    --case "3b-zero3-opt-param-offload-mb4x1024 (memtrain micro-batch and checkpointing auto)=recipes/openllama-3b-full-offload-24gb.yaml schedule.warmup_steps=2 :: batch.micro_batch=auto checkpointing.strategy=auto"
  ;;
speed6)  # next session: 7B LoRA levers not yet measured — ZeRO-0 (no per-parameter reduce hooks for the 448 LoRA
  # tensors; scripts/micro_batch_overhead.py times them on the CPU, no table committed yet), and HF itself
  # at micro-batch 1 (is the mb-1 slowness memtrain's?)
  lora=recipes/llama2-7b-lora-24gb.yaml
  step vs-hf 560 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 12 --warmup 3 --timeout 200 \
    --case "7b-lora-mb4x1024 (memtrain ZeRO-0, checkpointing auto)=$lora :: offload.zero_stage=0 checkpointing.strategy=auto" \
    --case "7b-lora-mb4x1024 (memtrain ZeRO-0, mb8, checkpointing auto)=$lora :: offload.zero_stage=0 batch.micro_batch=8 checkpointing.strategy=auto" \
    --case "7b-lora-mb1x1024 (both mb1; memtrain ZeRO-0, checkpointing auto)=$lora batch.micro_batch=1 :: offload.zero_stage=0 checkpointing.strategy=auto"
  ;;
heldout)  # the cases not yet measured with expandable segments: 1.1B NVMe, QLoRA
  # (needs the bitsandbytes wheel in .whl/)
  step plan-heldout 480 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 300 \
    --parallel 3 --host-budget-gib 105 --only 1.1b-nvme,qlora   # the NVMe case runs alone (session 5: 210 s)
  ;;
final)  # lean LoRA dropout: accuracy rows (held out) and 7B LoRA vs HF; the fixed NVMe parameter tier (1.1B)
  step plan-lean-nvme 175 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 170 \
    --parallel 5 --host-budget-gib 105 --only 1.1b-nvme,lean
  rm -rf /tmp/memtrain-nvme
  lora="recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2 model.lora.lean_dropout=true"
  step vs-hf 380 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 110 \
    --case "7b-lora-mb4x1024 (memtrain lean dropout, checkpointing auto)=$lora :: checkpointing.strategy=auto" \
    --case "7b-lora-mb4x1024 (memtrain lean dropout, mb8, checkpointing auto)=$lora :: batch.micro_batch=8 checkpointing.strategy=auto" \
    --case "7b-lora-mb4x1024 (memtrain lean dropout, mb16, checkpointing auto)=$lora :: batch.micro_batch=16 checkpointing.strategy=auto" \
    --case "7b-lora-mb4x1024 (memtrain lean dropout, ZeRO-0, mb8, checkpointing auto)=$lora :: offload.zero_stage=0 batch.micro_batch=8 checkpointing.strategy=auto"
  ;;
profile)  # memtrain run --profile 1 on 7B LoRA: the profile summary and per-step metrics land in $OUT
  for v in "mb8-auto::batch.micro_batch=8" "mb8-auto-lean::batch.micro_batch=8 model.lora.lean_dropout=true" \
           "mb1-auto::batch.micro_batch=1"; do
    name=${v%%::*}; dir=/tmp/memtrain-profile/$name
    step "profile-$name" 150 python3 -m memtrain run recipes/llama2-7b-lora-24gb.yaml ${v#*::} checkpointing.strategy=auto \
      train.steps=4 $quiet train.log_every=1 train.output_dir=$dir --no-resume --no-save --profile 1
    cp "$dir/profile_summary.txt" "$OUT/profile-$name.txt"; cp "$dir/metrics.jsonl" "$OUT/profile-$name.metrics.jsonl"
    python3 -c "import json,sys; [print(r['step'], round(r['step_time_s'],3), r.get('gpu_alloc_retries'), round(r['gpu_peak_reserved_bytes']/2**30,2)) for r in map(json.loads, open(sys.argv[1])) if r['kind']=='train']" "$dir/metrics.jsonl"
  done
  ;;
compile)  # 7B LoRA with compiled decoder layers against HF as Axolotl and LLaMA-Factory run it (eager)
  lora="recipes/llama2-7b-lora-24gb.yaml schedule.warmup_steps=2"
  step vs-hf 380 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 170 \
    --case "7b-lora-mb4x1024 (memtrain compiled layers, mb8, checkpointing auto)=$lora :: train.compile=true batch.micro_batch=8 checkpointing.strategy=auto" \
    --case "7b-lora-mb4x1024 (memtrain compiled layers, lean dropout, mb8, checkpointing auto)=$lora :: train.compile=true model.lora.lean_dropout=true batch.micro_batch=8 checkpointing.strategy=auto"
  ;;
equal3b)  # the offload goal asks for equal or lower peak memory than HF's measured 6.41 GiB (HF at mb 4 both times)
  three="recipes/openllama-3b-full-offload-24gb.yaml schedule.warmup_steps=2"
  step vs-hf 560 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 200 \
    --case "3b-zero3-opt-param-offload-mb4x1024 (memtrain as the recipe: mb 4, every layer)=$three" \
    --case "3b-zero3-opt-param-offload-mb4x1024 (memtrain mb8, every layer: plans 6.75 GiB)=$three :: batch.micro_batch=8"
  ;;
torch211)  # torch < 2.13 left a failed checkpointed region's hooks installed (the 7B LoRA every-2 CheckpointError)
  tests="tests/train/runtime/test_oom.py tests/train/test_run.py" only="checkpointed_layer or saved_tensor_hooks or layer_point"
  step "tests-with-fix" 90 env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider $tests -k "$only"
  sed -i 's/^    abandon_failed_frames(error)$/    pass/' memtrain/train/step/micro_batches.py
  step "tests-without-fix (expected to fail)" 90 env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider $tests -k "$only"
  sed -i 's/^    pass$/    abandon_failed_frames(error)/' memtrain/train/step/micro_batches.py
  grep -c "^    abandon_failed_frames(error)$" memtrain/train/step/micro_batches.py
  step plan-7b-every2 200 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 180 --only 7b-lora-every2-mb8-s512
  nvme="recipes/llama2-7b-nvme-24gb.yaml model.preset=tinyllama-1.1b batch.micro_batch=2 data.seq_len=1024 hardware.gpu=rtx3090
        hardware.cap_memory=true train.steps=3 schedule.warmup_steps=1 $quiet train.log_every=1"
  step segments-nvme 240 python3 scripts/memory_segments.py $nvme hardware.nvme_path=/tmp/nvme-seg train.output_dir=/tmp/seg-nvme \
    --out "$OUT/segments-1.1b-nvme.json"
  step segments-cpu 150 python3 scripts/memory_segments.py $nvme offload.optimizer=cpu offload.params=cpu train.output_dir=/tmp/seg-cpu \
    --out "$OUT/segments-1.1b-zero3-cpu.json"
  ;;
equal3b-chunk)  # mb 8 measured 6.49 GiB, 0.08 above HF: smaller loss chunks free the rest (planner: -0.19 / -0.28 GiB)
  three="recipes/openllama-3b-full-offload-24gb.yaml schedule.warmup_steps=2"
  step vs-hf 560 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 8 --warmup 2 --timeout 200 \
    --case "3b-zero3-opt-param-offload-mb4x1024 (memtrain mb8, loss chunks of 256 tokens)=$three :: batch.micro_batch=8 precision.loss_chunk_tokens=256" \
    --case "3b-zero3-opt-param-offload-mb4x1024 (memtrain mb8, loss chunks of 512 tokens)=$three :: batch.micro_batch=8 precision.loss_chunk_tokens=512"
  ;;
equal3b-live)  # mb 8 with fewer parameters kept gathered between forward and backward (planner: 6.75 -> 4.69 GiB)
  three="recipes/openllama-3b-full-offload-24gb.yaml schedule.warmup_steps=2"
  step vs-hf 380 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 6 --warmup 2 --timeout 130 \
    --case "3b-zero3-opt-param-offload-mb4x1024 (memtrain mb8, max_live_parameters 3e8)=$three :: batch.micro_batch=8 offload.max_live_parameters=300000000" \
    --case "3b-zero3-opt-param-offload-mb4x1024 (memtrain mb8, max_live_parameters 5e8)=$three :: batch.micro_batch=8 offload.max_live_parameters=500000000"
  ;;
segments2)  # session 7: per-stream segments from before the model is built, for the ZeRO-3 reserved model
  one="model.preset=tinyllama-1.1b batch.micro_batch=2 data.seq_len=1024 hardware.gpu=rtx3090 hardware.cap_memory=true
       train.steps=3 schedule.warmup_steps=1 $quiet train.log_every=1"
  step segments-cpu 110 python3 scripts/memory_segments.py recipes/llama2-7b-nvme-24gb.yaml $one offload.optimizer=cpu \
    offload.params=cpu train.output_dir=/tmp/seg-cpu --out "$OUT/segments-1.1b-zero3-cpu.json"
  step segments-3b 200 python3 scripts/memory_segments.py recipes/openllama-3b-full-offload-24gb.yaml batch.micro_batch=4 \
    batch.global_batch=8 data.seq_len=1024 train.steps=3 schedule.warmup_steps=1 $quiet train.log_every=1 \
    train.output_dir=/tmp/seg-3b --out "$OUT/segments-3b-zero3-cpu.json"
  step segments-nvme 250 python3 scripts/memory_segments.py recipes/llama2-7b-nvme-24gb.yaml $one hardware.nvme_path=/tmp/nvme-seg \
    train.output_dir=/tmp/seg-nvme --out "$OUT/segments-1.1b-nvme.json"
  ;;
streams)  # session 7: the held-out NVMe row (predicted 2.30 GiB before it ran)
  step plan-nvme-mb4 300 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 280 --only 1.1b-nvme-mb4
  ;;
peaks)  # session 8: the NVMe plan grew 0.42 GiB from micro-batch 2 to 4, the run 0.21: what is live at the peak
  one="model.preset=tinyllama-1.1b batch.global_batch=8 data.seq_len=1024 hardware.gpu=rtx3090 hardware.cap_memory=true
       train.steps=3 schedule.warmup_steps=1 $quiet train.log_every=1"
  for mb in 2 4; do
    step peaks-cpu-mb$mb 140 python3 scripts/memory_segments.py recipes/llama2-7b-nvme-24gb.yaml $one batch.micro_batch=$mb \
      offload.optimizer=cpu offload.params=cpu train.output_dir=/tmp/peak-cpu-$mb --out "$OUT/peaks-1.1b-zero3-cpu-mb$mb.json"
  done
  step peaks-nvme-mb4 280 python3 scripts/memory_segments.py recipes/llama2-7b-nvme-24gb.yaml $one batch.micro_batch=4 \
    hardware.nvme_path=/tmp/nvme-peak train.output_dir=/tmp/peak-nvme --out "$OUT/peaks-1.1b-nvme-mb4.json"
  ;;
heldout8)  # session 8: predicted 2.84 / 5.02 / 4.55 GiB reserved before they ran (PEAKS in plan_accuracy.py)
  step heldout-nvme 250 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 240 --only 1.1b-nvme-mb8
  step heldout-zero3 260 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 250 \
    --only 3b-zero3-cpu-every-mb2-s2048,1.1b-zero3-cpu-every-mb8
  ;;
final8)  # session 8: device time for one call only
  step heldout-zero3 240 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 200 \
    --only 3b-zero3-cpu-every-mb2-s2048,1.1b-zero3-cpu-every-mb8
  three="recipes/openllama-3b-full-offload-24gb.yaml schedule.warmup_steps=2"
  step vs-hf 300 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 6 --warmup 2 --timeout 130 \
    --case "3b-zero3-opt-param-offload-mb4x1024 (memtrain mb8, max_live_parameters 5e8)=$three :: batch.micro_batch=8 offload.max_live_parameters=500000000"
  ;;
prefetch)  # 3B at equal memory again (session 7's 1.50x was at the threshold, HF varies ~5 % between invocations),
  # beside a prefetch bucket of most of a layer (1e8 elements), so the next layer's fetch overlaps compute
  three="recipes/openllama-3b-full-offload-24gb.yaml schedule.warmup_steps=2"
  step vs-hf 450 python3 scripts/bench_vs_hf.py --out "$OUT/vs_hf.csv" --steps 6 --warmup 2 --timeout 130 \
    --case "3b-zero3-opt-param-offload-mb4x1024 (memtrain mb8, max_live_parameters 5e8)=$three :: batch.micro_batch=8 offload.max_live_parameters=500000000" \
    --case "3b-zero3-opt-param-offload-mb4x1024 (memtrain mb8, max_live_parameters 5e8, prefetch 1e8)=$three :: batch.micro_batch=8 offload.max_live_parameters=500000000 offload.prefetch_bucket_size=100000000"
  ;;
accuracy)
  step plan-all 560 python3 scripts/plan_accuracy.py --out "$OUT/plan_accuracy.csv" --timeout 400 --calibrate \
    --parallel 5 --host-budget-gib 105 ${ONLY:+--only $ONLY}
  ;;
esac
for f in /tmp/memtrain-bench/*.log /tmp/memtrain-plan-accuracy/*.log /tmp/memtrain-vs-hf/*.log /tmp/memtrain-startup/*.log; do
  [ -f "$f" ] && grep -l -i -E "Traceback|Error" "$f" >/dev/null && { echo "== $f"; grep -i -E -B2 -A8 "Traceback|Error" "$f" | tail -n 30; }
done
echo "== done at ${SECONDS}s"
