#!/usr/bin/env bash
# On the GPU machine (after stage.sh + prepare.sh): run named suites one after another, each logging to
# $OUT/<name>.log; measured numbers go to $OUT/results.jsonl. The benchmarks write their JSON/markdown to
# /tmp/bench-results, which lives as long as the machine (later calls merge into it and compare against
# it), and every call copies it all to $OUT.
# A failing suite does not stop the next; the exit status is the number of failed suites.
#   bash scripts/device/suite.sh contract shared-sleep
# Suites: contract (or its halves contract-adapters and contract-requests) shared-sleep shared-restart sync split replicas-1gpu bench-trainer, faults-split (2 GPUs)
# and faults-shared (server SIGKILL/SIGSTOP during and between steps, user script SIGKILL; ~4 min each),
# ddp (2 GPUs: data-parallel trainer ranks, ~4 min), and the benchmarks (minutes on an H100 with the 1.5B
# shape; each call of `run` has 10):
#   bench-trainer-ddp (2 GPUs, ~3 min): Unsloth trainer tokens/s on 1 vs 2 ranks, the same batch, ART's
#     row packing and 16k-token rows, into bench_trainer_ddp.json/.md
#   bench-cycle-kv bench-cycle-all (~3.5 min each), bench-cycle-restart (~6 min): shared-mode steps
#     through the backend, one strategy each, merged into bench_cycle-<model>.json; bench-cycle-auto
#     (~3 min): sleep/kv_cache with mem_fraction_static unset (the plan shrinks it), its own JSON
#   bench-inference (~6 min): SGLang, radix cache on and off; bench-vllm (~4 min, after stage.sh vllm 0..5):
#     vLLM on the same workloads; bench-engines (seconds when both ran before, else runs what is missing);
#     bench-inference-lpm (~4 min): SGLang with --schedule-policy lpm; bench-vllm-triton (~4 min): vLLM with
#     Triton attention, as SGLang ran here before the kit shipped FlashAttention-3
#   models-7b (~2 min): builds qwen2.5-7b-shape; BENCH_MODEL=/root/models/qwen2.5-7b-shape then points
#     the benchmarks at it
#   bench-multiturn (~5 min): tic-tac-toe through the backend, prefix-cache hit rate per turn
#   bench-rollouts-sglang (~8 min at 1.5B, twice at 7B): scripts/bench_rollouts.py, ART's rollout requests
#     sent with ART's own client through SGLangBackend with prefill sharing on (and off too for the varying
#     and multi-turn runs) (16 and 32 groups of 8, 128 and 384 tokens, varying lengths, multi-turn; 3 repeats
#     of >= 10 s each; lone-request TTFT). A call starts no run after 470 s and keeps what it measured; the
#     next call of the same suite goes on from there (--resume) until every run is in. bench-rollouts-vllm
#     (~6 min at 1.5B, after stage.sh vllm 0..5; again at 7B if cut): the same on vLLM as ART serves and
#     drives it. bench-rollouts (seconds): both into bench_rollouts-<model>.json/.md with the ratios
#     backend / vLLM. BENCH_RUNS='KIND-TOKENS:GROUPS ...' runs only those (scripts/bench_rollouts.py --runs)
#   probe-costs (~7 min): scripts/probe_rollout_costs.py, ART's GRPO waves (32 groups x 8, 128 tokens) sent with
#     ART's client straight to SGLang, through the gateway with prefill sharing off and on, with a bare client,
#     and as n=8 per group, 3 repeats each, into probe_costs-<model>.json; probe-costs-trained-modules (~5 min):
#     the gateway and bare ways with SGLang adapting only the trainer's modules (not lm_head/embed_tokens);
#     probe-costs-vllm (~5 min, after stage.sh vllm 0..5): vLLM with ART's client and with a bare one;
#     probe-costs-http (~5 min, after models-random): the real-vocabulary model, bare client with and without
#     logprobs and through the gateway, py-spy samples of every server process during the bare waves
#   Issue 39's side-by-side (scripts/bench_rollouts.py on models with Qwen2.5's vocabulary; ART's client and a
#     bare one; each suite one server start, JSON r39-<suite>-<model>.json; A/B/A: r39-backend-a1, r39-vllm,
#     r39-backend-a2 on one machine, back to back). Minutes on an H100 at 1.5B (starts: backend ~2, vLLM ~2.5,
#     SGLang ~1.5), one call each:
#     models-random (~1 min, once; models-random-7b ~2 min): builds qwen2.5-1.5b-random (-7b-random), which
#       RMODEL=/root/models/qwen2.5-7b-random then points these suites at
#     r39-backend-a1 (~7), r39-vllm (~7.5): bare client on grpo-128:32 grpo-128:16 grpo-1024:16 varying-384:32
#       multiturn-64:32, ART's client too on the 128-token ones; lone-request TTFT (the backend with its defaults)
#     r39-backend-triton (~7): r39-backend-a1 with the triton LoRA path asked for by name (--lora-backend
#       triton, 0.5.17's experimental path: the default since 2026-11-28, so the same server as a1's);
#       r39-direct-triton (~3): r39-direct-exact on that path
#     r39-backend-a2 (~5): the backend again, bare, grpo-128:32 and grpo-1024:16, through its gateway and
#       straight to its own server (the gateway's share of the backend's cost, on the same live server)
#     r39-direct-exact (~3): SGLang launched exactly as the backend launches it (flags, keys, the gateway's
#       request form), no gateway, no trainer; r39-drop-<suspect> (~3 each): the same without one suspect
#       (memory-saver, weights-backup, metrics, keys, token-ids, original-logprob, tool-parser)
#     r39-lora-<variant> (~4, < 7 each; 4 at once on 4 GPUs: per_gpu.sh; variants triton, triton-loras-1,
#       exp-opti, exp-cublas, rank-64, no-prefill-graph, loras-2, exp-opti-eager-prefill): the same with one LoRA
#       serving change: triton (--lora-backend triton; its prefill graphs cut into 16-row segments by the default
#       triton-prefill-grid backport), rank-64 (--max-lora-rank 64, SGLangConfig's default before it took the
#       trainer's rank, against the bench's 16), no-prefill-graph (--disable-prefill-cuda-graph), loras-2
#       (--max-loras-per-batch 2), exp-opti-eager-prefill (exp-opti with --disable-prefill-cuda-graph)
#     lora-logprob-ab (~4): scripts/lora_logprob_ab.py, a LoRA variant's logprobs against a baseline's (greedy
#       decode of 200 requests at once and teacher-forced prefill; max/mean |diff|; each server's decode against
#       its own teacher-forced prefill of the same ids: decode_vs_prefill); VARIANT_LORA and BASELINE_LORA name
#       each side's LoRA kernels (default: the triton path against csgmv; BASELINE_LORA='--baseline-lora-
#       backend triton --baseline-lora-experimental-path' for the triton path against itself), VARIANT_ENV /
#       BASELINE_ENV ('K=V ...') and VARIANT_ARGS / BASELINE_ARGS ('--flag ...') change a side further,
#       PROMPT_TOKENS the prompts' length (default 64)
#     r39-vllm-base (~4.5): vLLM serving the base weights, no LoRA (ART's merged mode's stand-in), bare
#     r39-backend-merged (~6.5): issue 40's merged mode (weight_sync_method='merged': the server without LoRA,
#       measured after one trained step whose merged weights the trainer pushed), bare client on grpo-128:32
#       grpo-128:16 grpo-1024:16, ART's client too on the 128-token ones; "backend, merged" in r39-compare
#     r39-backend-merged-no-memo (~6.5): the same without the chat-template-memo backport (the HTTP process
#       tokenizes every request's prompt, as SGLang does), label "no memo"
#     r39-http-workers, r39-mixed-chunk (~4 each, 4 at once with r39-drop-keys and r39-drop-token-ids on
#       4 GPUs: per_gpu.sh): where a wave's time goes outside decode, SGLang's one HTTP process (4 workers,
#       no keys, against r39-drop-keys) and admission prefills (--enable-mixed-chunk)
#     r39-drop-backports, r39-drop-<backport> (~3 each): r39-direct-exact without art_sglang's backports
#       (SGLang as released), or without one of them (json-response, gumbel-sampling, chat-template-memo,
#       csgmv-decode-grid, evict-without-gc, evict-ahead)
#     r39-compare (seconds): every r39-*-<model>.json into bench_rollouts39-<model>.json/.md (docs' table)
#   Issue 39's decode stalls (once its KV pool was full, SGLang 0.5.17 stalled ~0.5 s about every 1.3 s: its
#     radix cache's eviction and Python's collector; the default backports evict-without-gc and evict-ahead
#     remove them): one workload (bare client, 30 s runs of grpo-128:32, grpo-128:16, grpo-1024:16: enough to
#     fill the 1.5B's KV pool, which the stalls' onset followed) on stall-backend (SGLangBackend as
#     r39-backend-a1 runs it), stall-released-eviction (both eviction backports off), stall-only-evict-without-gc
#     and stall-only-evict-ahead (one of them), stall-no-watchdog (its watchdog never probes the
#     server), stall-direct (SGLang launched as the backend launches it, no trainer, no gateway, no watchdog)
#     and stall-direct-trainer (the same beside the backend's trainer worker, idle, on its GPU); ~7.5 min for the backend's, ~6.5 for the direct ones
#     at 1.5B, 4 at once on 4 GPUs (per_gpu.sh); JSON stall-<suite>-<model>.json
#     (per run: the radix cache's evictions, slow ones too; the trainer's CPU seconds), nvidia-smi pmon of the GPU
#     in $OUT/<suite>-pmon.txt, py-spy samples of the server's processes over the first 1,024-token run in
#     $OUT/<suite>-profile/. After every r39-* and stall-* suite scripts/decode_stalls.py reads its server logs
#     ("=== stalls:" lines).
#     RUNS='KIND-TOKENS:GROUPS[@CLIENT] ...' replaces a suite's runs; ART_SGLANG_COMMIT=<sha> records the commit;
#     TAG=b keeps a second instance's folder and JSON apart (one suite's workloads split over two GPUs);
#     BACKPORTS_WITH=NAME[,NAME] adds opt-in backports (none at present) to every server of the call
#   bench-pipeline-1gpu (~4 min, after stage.sh art): ART's PipelineTrainer vs the synchronous loop, same
#     workload and seed, server and trainer co-resident on GPU 0 (CUDA MPS where the driver has it);
#     bench-pipeline-1gpu-no-mps the same with cuda_mps="off"; bench-pipeline-split: server on GPU 0,
#     trainer on GPU 1 (2 GPUs); bench-pipeline-1gpu-merged, bench-pipeline-split-merged: the same serving
#     merged weights (issue 40); PIPELINE_TOKENS=N answers of up to N tokens (default 384), TAG=x a repeat's
#     or a variant's own JSON (bench_pipeline-<suite>-x.json) and work folder
#   bench-replicas (~5 min, 2 GPUs, stage.sh router first): rollout tokens/s of 1 replica vs 2 through the
#     backend's gateway and through SGLang's router (cache-aware, round-robin), with their prefix-cache hit rates
#   flags-default flags-all-modules flags-chunk-128 flags-no-overlap (~3.5 min each at 1.5B): the
#     backend's GRPO runs (32 groups, 384 and 128 tokens) with its defaults and with one serving flag
#     changed (LoRA on every module, lm_head and embed_tokens too; --max-lora-chunk-size 128;
#     --disable-overlap-schedule), each into flags-<variant>.json
#   bench-register, bench-register-no-prefill-graphs (~3 min each): register() of one shared-mode backend,
#     where SGLang's start went (weights, decode and prefill CUDA graphs), one step, close()
# Four GPUs (H100x4 or H200x4): four-gpu (~4.5 min) runs SGLangBackend(inference_device=0,
#   training_devices=[1, 2, 3]) through 3 synchronous and 2 pipelined steps on the 1.5B shape (GPU roles and
#   memory per step, nothing left after close()), four-gpu-7b the same on the 7B shape (~7 min, after
#   models-7b); bench-trainer-ddp3 (~4.5 min at 1.5B, ~5.5 at 7B; after models-random, or BENCH_MODEL with
#   models-random-7b): trainer tokens/s and where a step's time goes on 1, 2 and 3 ranks; bench-trainer-ddp3-mb24k (~3.5 min): the same with a row's share forwarded as one micro-batch
#   (does a row's second micro-batch cost more than its first?); bench-trainer-ddp3-b192 (~4 min): the same
#   with 192 trajectories a step (24 GRPO groups of 8); loss-curves-3 (~3.5 min): scripts/loss_curves.py,
#   8 steps of one model and seed on 1 rank twice and on 3 ranks; bench-trainer-ddp3-nockpt(-mb24k) (~3.5 min
#   each): bench-trainer-ddp3(-mb24k) without gradient checkpointing; bench-trainer-ddp3-gap (~4.5 min): 5 s
#   idle before each timed step (rank 0's background write of the step before then done); bench-trainer-ddp3-profile (~2.5 min): a
#   torch.profiler timeline of a step on 1 and on 3 ranks into $OUT/trainer-profile-*; bench-pipeline-four-gpu (~5 min, after stage.sh art): ART's PipelineTrainer vs the synchronous loop
#   on the example's layout; bench-pipeline-replicas (~4 min, after stage.sh art and router): the same with 2
#   replicas (GPUs 0-1) and 2 ranks (GPUs 2-3)
# replicas-1gpu (~4 min, 1 GPU, stage.sh router first): two replicas on the first visible GPU behind the router
# ray-cluster-1gpu (~8 min, 1 GPU, stage.sh router and ray first): two simulated Ray nodes sharing the GPU,
#   one SGLang replica each, through `cluster=` on the 1.5B shape: steps, adapter propagation time, a node
#   lost and added back, rollout tokens/s
# ray-cluster-baseline (~4 min, 1 GPU, stage.sh router first): rollout tokens/s of the same two replicas
#   without Ray, run beside ray-cluster-1gpu on the same machine
# cuda-mps (~3 min, 1 GPU): co-resident server and trainer as clients of the backend's CUDA MPS daemon
# adapter-faults (~6 min, 1 GPU): n>1 in every spelling refused on an adapter, then 3 steps published; a
#   server SIGKILLed as a step's adapter loads, waited out. contract-n (~2 min): what SGLang makes of each
#   spelling of n and of a length refusal (tests/contract/test_adapter_release.py, printed with -s)
# burst (~3 min, 1 GPU): waves of rollouts with hot-loads and idle gaps past SGLang's keep-alive, none lost
# shared-prefill (~2 min): the contract test of prefill sharing alone (the contract suite includes it)
# contract-weights (~4 min, 1 GPU): issue 40's contract tests alone (weight pushes, update groups, pause)
# sync-merged (~3 min, 1 GPU): weight_sync_method='merged' on SGLang, one step in shared mode (the sync suite includes it;
#   on more GPUs it also runs the NCCL layouts below). sync-merged-split (~3 min, 2 GPUs): the push by NCCL
#   broadcast, server on GPU 0, trainer on GPU 1. sync-merged-nccl (~8 min, 3 GPUs): split, two replicas
#   (GPUs 0 and 1) in one group from GPU 2, and a trainer of 2 ranks (GPUs 1, 2) whose rank 0 sends
# merged-in-flight (~4 min, 1 GPU): merged weights co-resident; a long whole and a long streamed rollout
#   across a step are continued on the new weights, one choice each with two version spans, trained on
# merged-vs-lora (~5 min, 1 GPU): 50 merged steps (shared mode), then the served logprobs of fixed ids against
#   SGLang with LoRA holding the 50th step's adapter (max abs <= 0.05, the base model >= 0.2 away)
# merged-crash-push (~5 min, 1 GPU): the server SIGKILLed once the first bucket of a step's push loaded; the
#   step returns and its name serves that step's whole weights (against SGLang holding its adapter)
# bench-weight-push (~3 min, 1 GPU): merged-weight sync by CUDA IPC (shared mode), buckets of 128/512/2048
#   MiB, merge and whole sync (pause to first token) per step; bench-weight-push-nccl (~3 min, 2 GPUs): the
#   same by NCCL broadcast from GPU 1 (split mode). BENCH_MODEL=... for the 7B shape
# art-program (~4 min, after stage.sh art): an ART program with tools and _internal_config, 2 RL steps;
#   art-program-merged (~6 min, 2 GPUs; split skipped on 1): an ART program with rollout_weights_mode="merged",
#   3 RL steps in shared and in split mode
# constrained (~5 min, 1 GPU): tic-tac-toe with an action mask trains 3 steps on the 1.5B shape; where SGLang
#   takes a constrained token's logprob; the trainer against it for an action mask and a regex
# Several 1-GPU suites at once, one list per GPU: scripts/device/per_gpu.sh.
set -uo pipefail
# shellcheck source=scripts/device/env.sh
source scripts/device/env.sh
export ART_SGLANG_GPU_RESULTS="$OUT/results.jsonl"
tiny=$ART_SGLANG_GPU_TINY
big=${BENCH_MODEL:-$ART_SGLANG_GPU_REALISTIC}
# SGLang picks its own attention (FlashAttention-3 on Hopper; the kit ships it since 2026-11-25). Sampling
# stays on PyTorch: FlashInfer's sampling kernels are compiled at their first use and this machine has no
# CUDA compiler (with temperature-only sampling SGLang draws with torch.multinomial under either backend).
kernels=(--sampling-backend pytorch)
vllm_kernels=(--attention-backend FLASH_ATTN)
results=/tmp/bench-results
mkdir -p "$results"
cycle=(python3 scripts/bench_cycle.py --model "$big" "${kernels[@]}" --merge
       --json "$results/bench_cycle-${big##*/}.json" --markdown "$results/bench_cycle-${big##*/}.md")
inference=(python3 scripts/benchmark_inference.py --model "$big")
# Completions of up to 384 tokens: with 96 (the first H200 run) rollouts were ~1.5 s of a ~5 s step, too
# little to overlap for pipelining to show.
# 8 steps: the first of each loop (the trainer compiling) is left out of the steady-state rate.
# TORCH_LOGS=recompiles: the trainer logs (kept below, from /tmp/work-<suite>) say whether a slow step in the
# middle of a run (22 s against 4, bench-pipeline-replicas 2026-11-28) compiled a new shape.
# PIPELINE_TOKENS=N asks for answers of up to N tokens instead (rollouts then weigh more against training).
pipeline=(env TORCH_LOGS=recompiles python3 scripts/bench_pipeline.py --model "$big" "${kernels[@]}" --steps 8
          --max-tokens "${PIPELINE_TOKENS:-384}")
# 470 s: the last run to start (10-35 s at 7B) and the server's stop end before the call's 10 minutes.
probe=(python3 scripts/probe_rollout_costs.py --model "$big" --lora-rank 16 --seconds 10 --repeats 3 --workdir /tmp/work-probe)
# Issue 26's runs as they were measured: ART's client only, prefill sharing off too for varying and multiturn.
rollouts=(python3 scripts/bench_rollouts.py --model "$big" --resume --deadline-s 470 --clients art
          --off-kinds varying multiturn --runs grpo-128:32 grpo-128:16 varying-384:32 multiturn-64:32 grpo-384:32 grpo-384:16)
# BENCH_RUNS="grpo-128:32 grpo-128:16" picks the rollout runs (the 7B shape's runs take twice as long).
# shellcheck disable=SC2206
[ -z "${BENCH_RUNS:-}" ] || rollouts+=(--runs $BENCH_RUNS)
# Issue 39: models with Qwen2.5's vocabulary; every suite starts its own server (470 s, or R39_DEADLINE_S: the
# last run and the server's stop end before the call's 10 minutes; a cut suite goes on with --resume when called
# again).
rmodel=${RMODEL:-/root/models/qwen2.5-1.5b-random}
# Issue 43's data-parallel trainer benches: the real vocabulary too (its LM head and logprobs are a step's
# largest layer at 1.5B), after models-random; BENCH_MODEL picks another.
tmodel=${BENCH_MODEL:-$rmodel}
r39=(python3 scripts/bench_rollouts.py --model "$rmodel" --resume --deadline-s "${R39_DEADLINE_S:-470}")
r39_main="grpo-128:32 grpo-128:16 grpo-1024:16@bare varying-384:32@bare multiturn-64:32@bare"
r39_split="grpo-128:32@bare grpo-1024:16@bare"
stall=(--clients bare --ttft-requests 0 --min-seconds 30 --runs grpo-128:32@bare grpo-128:16@bare grpo-1024:16@bare
       --profile-run grpo-1024:16)
# SGLang 0.5.17's experimental triton LoRA path: each shrink on a second stream beside the base GEMM, down_proj's
# shrink split; the second variable keeps it right under CUDA graphs.
exp_opti=(SGLANG_EXPERIMENTAL_LORA_OPTI=1 SGLANG_OPT_LORA_OVERLAP_MAIN_ALLOC=1)
# The ART_SGLANG_BACKPORTS value of the default backports but one (or a comma list).
backports_without() {
  python3 -c "from art_sglang.serving.servers.sglang_site import art_sglang_backports as b; print(b.without('$1'))"
}
# ... and of the default backports and opt-in ones (NAME or a comma list; without() of names not among the
# defaults is all of them).
backports_with() { echo "$(backports_without "$1"),$1"; }
# BACKPORTS_WITH=NAME[,NAME...]: every server of the call gets the default backports and these opt-in ones
# (a suite that chooses its own keeps them); the r39/stall JSON names what each server ran (launch.backports).
[ -z "${BACKPORTS_WITH:-}" ] || export ART_SGLANG_BACKPORTS="$(backports_with "$BACKPORTS_WITH")"
# The triton LoRA path by name (issue 39; SGLangConfig's default since 2026-11-28): the triton kernels on SGLang
# 0.5.17's experimental path.
triton_lora=(--lora-backend triton --lora-experimental-path)
pytest=(python3 -m pytest -p no:cacheprovider -v -rA --tb=short --timeout 590)
failed=0
for name in "$@"; do
  start=$(date +%s)
  # An r39/stall suite's folder and JSON: the model in the name (the same suite on two models at once, RMODEL
  # per GPU), and TAG where the same suite runs twice at once (per_gpu.sh lists with TAG=b, other RUNS).
  run_name="$name${TAG:+-$TAG}-${rmodel##*/}"
  # A bench-pipeline suite's JSON and markdown (TAG keeps a repeat or a PIPELINE_TOKENS run apart).
  pipe_out="$results/${name/bench-pipeline/bench_pipeline}${TAG:+-$TAG}"
  work="/tmp/work-$run_name"
  case $name in
    contract) cmd=("${pytest[@]}" tests/contract --engine sglang --model-path "$tiny") ;;
    # The contract suite in two halves of about equal time, for two GPUs at once (per_gpu.sh).
    contract-adapters) cmd=("${pytest[@]}" tests/contract/test_adapter_release.py tests/contract/test_adapters.py
                            tests/contract/test_golden.py tests/contract/test_release_under_load.py
                            tests/contract/test_shared_prefill.py --engine sglang --model-path "$tiny") ;;
    contract-requests) cmd=("${pytest[@]}" tests/contract/test_serving.py tests/contract/test_constraints.py
                            tests/contract/test_stops.py tests/contract/test_reference_flags.py
                            --engine sglang --model-path "$tiny") ;;
    # Issue 40: weights pushed and broadcast while serving, pause/continue (the contract suite includes them).
    contract-weights) cmd=("${pytest[@]}" tests/contract/test_weight_updates.py tests/contract/test_pause_generation.py
                           --engine sglang --model-path "$tiny") ;;
    shared-sleep) cmd=("${pytest[@]}" -m gpu tests/gpu/test_shared_mode.py -k sleep) ;;
    shared-restart) cmd=("${pytest[@]}" -m gpu tests/gpu/test_shared_mode.py -k restart) ;;
    sync) cmd=("${pytest[@]}" -m gpu tests/gpu/test_sync_methods.py) ;;
    sync-merged) cmd=("${pytest[@]}" -m gpu tests/gpu/test_sync_methods.py -k merged) ;;
    merged-in-flight) cmd=("${pytest[@]}" -m gpu tests/gpu/test_merged_updates_on_gpu.py) ;;
    merged-vs-lora) cmd=("${pytest[@]}" -m gpu tests/gpu/test_merged_against_lora_on_gpu.py -k lora_serves) ;;
    merged-crash-push) cmd=("${pytest[@]}" -m gpu tests/gpu/test_merged_against_lora_on_gpu.py -k killed_mid_push) ;;
    sync-merged-split) cmd=("${pytest[@]}" -m gpu tests/gpu/test_sync_methods.py -k merged-split) ;;
    sync-merged-nccl) cmd=("${pytest[@]}" -m gpu tests/gpu/test_sync_methods.py
                           -k "merged-split or merged-replicas or merged-ranks") ;;
    split) cmd=("${pytest[@]}" -m gpu tests/gpu/test_split_mode.py) ;;
    art-program) cmd=("${pytest[@]}" -m gpu tests/gpu/test_art_program.py) ;;
    art-program-merged) cmd=("${pytest[@]}" -m gpu tests/gpu/test_art_program_merged.py) ;;
    faults-split) cmd=("${pytest[@]}" -m gpu tests/gpu/test_parent_kill.py tests/gpu/test_faults.py -k split) ;;
    faults-shared) cmd=("${pytest[@]}" -m gpu tests/gpu/test_parent_kill.py tests/gpu/test_faults.py -k shared) ;;
    adapter-faults) cmd=("${pytest[@]}" -m gpu tests/gpu/test_adapter_faults_on_gpu.py) ;;
    contract-n) cmd=("${pytest[@]}" -s tests/contract/test_adapter_release.py --engine sglang --model-path "$tiny") ;;
    replicas-1gpu) cmd=("${pytest[@]}" -m gpu tests/gpu/test_replicas.py) ;;
    ray-cluster-1gpu) cmd=("${pytest[@]}" -m gpu tests/gpu/test_ray_cluster.py -k "not without_ray") ;;
    ray-cluster-baseline) cmd=("${pytest[@]}" -m gpu tests/gpu/test_ray_cluster.py -k without_ray) ;;
    cuda-mps) cmd=("${pytest[@]}" -m gpu tests/gpu/test_cuda_mps.py) ;;
    burst) cmd=("${pytest[@]}" -m gpu tests/backend/test_gateway_burst.py) ;;
    shared-prefill) cmd=("${pytest[@]}" tests/contract/test_shared_prefill.py --engine sglang --model-path "$tiny") ;;
    ddp) cmd=("${pytest[@]}" -m gpu tests/gpu/test_training_ranks.py) ;;
    # The SGLang bundle's own xgrammar (and its tvm-ffi runtime), linked in alone, so the trainer replays
    # regex rollouts with the grammar library SGLang sampled them with.
    constrained) python3 scripts/device/link_site_modules.py /tmp/xgsite xgrammar
                 cmd=(env PYTHONPATH="/tmp/xgsite:$PYTHONPATH" "${pytest[@]}" -m gpu tests/gpu/test_constrained.py) ;;
    bench-cycle-kv) cmd=("${cycle[@]}" --strategies sleep/kv_cache --steps 3) ;;
    bench-cycle-all) cmd=("${cycle[@]}" --strategies sleep/all --steps 3) ;;
    bench-cycle-restart) cmd=("${cycle[@]}" --strategies restart --restart-steps 2) ;;
    # mem_fraction_static left unset, as a user leaves it: the shared-mode plan sizes the server's pool.
    bench-cycle-auto) cmd=(python3 scripts/bench_cycle.py --model "$big" "${kernels[@]}" --mem-fraction-static auto
                           --strategies sleep/kv_cache --steps 3 --workdir /tmp/work-bench-cycle-auto
                           --json "$results/bench_cycle_auto-${big##*/}.json"
                           --markdown "$results/bench_cycle_auto-${big##*/}.md") ;;
    bench-register | bench-register-no-prefill-graphs)
      cmd=(python3 scripts/bench_cycle.py --model "$big" "${kernels[@]}" --strategies sleep/kv_cache --steps 1
           --workdir "/tmp/work-$name" --json "$results/$name.json" --markdown "$results/$name.md")
      [ "$name" = bench-register ] || cmd+=(--no-prefill-cuda-graph) ;;
    # Issue 40: merged-weight sync cost, trainer memory to servable (scripts/bench_weight_push.py).
    bench-weight-push) cmd=(python3 scripts/bench_weight_push.py --model "$big" "${kernels[@]}" --lora-rank 16
                            --transport tensor --device cuda:0 --bucket-mb 128 512 2048 --repeats 5
                            --workdir /tmp/work-push --json "$results/bench_weight_push-tensor-${big##*/}.json"
                            --markdown "$results/bench_weight_push-tensor-${big##*/}.md") ;;
    bench-weight-push-nccl) cmd=(python3 scripts/bench_weight_push.py --model "$big" "${kernels[@]}" --lora-rank 16
                                 --transport distributed --device cuda:1 --bucket-mb 128 512 2048 --repeats 5
                                 --workdir /tmp/work-push --json "$results/bench_weight_push-nccl-${big##*/}.json"
                                 --markdown "$results/bench_weight_push-nccl-${big##*/}.md") ;;
    bench-inference) cmd=("${inference[@]}" --engine sglang "${kernels[@]}" --prefix-cache on off
                          --json "$results/bench_inference.json" --markdown "$results/bench_inference.md") ;;
    bench-vllm) cmd=("${inference[@]}" --engine vllm "${vllm_kernels[@]}"
                     --json "$results/bench_vllm.json" --markdown "$results/bench_vllm.md") ;;
    # The two questions the first side-by-side left (H200, 2026-11-24): SGLang's grpo groups found 43-56 % of
    # their prompts cached against vLLM's 87 % (SGLang's default fcfs queue prefills a group's identical
    # prompts together; lpm holds all but one back), and SGLang ran Triton attention against vLLM's FA3.
    bench-inference-lpm) cmd=("${inference[@]}" --engine sglang "${kernels[@]}" --sglang-args="--schedule-policy lpm"
                              --json "$results/bench_inference_lpm.json"
                              --markdown "$results/bench_inference_lpm.md") ;;
    bench-vllm-triton) cmd=("${inference[@]}" --engine vllm --attention-backend TRITON_ATTN
                            --json "$results/bench_vllm_triton.json" --markdown "$results/bench_vllm_triton.md") ;;
    bench-engines) cmd=(python3 scripts/bench_engines.py --model "$big" --sglang-flags "${kernels[*]}"
                        --vllm-flags "${vllm_kernels[*]}" --reuse "sglang=$results/bench_inference.json"
                        --reuse "vllm=$results/bench_vllm.json" --workdir /tmp/bench-engines
                        --json "$results/bench_engines.json" --markdown "$results/bench_engines.md") ;;
    probe-costs) cmd=("${probe[@]}" "${kernels[@]}" --ways art-client gateway gateway-share raw raw-n
                      --json "$results/probe_costs-${big##*/}.json") ;;
    probe-costs-trained-modules) cmd=("${probe[@]}" "${kernels[@]}" --ways gateway-share raw
                                      --lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
                                      --json "$results/probe_costs_trained_modules-${big##*/}.json") ;;
    # Where a short-answer wave's time goes outside the GPU, with the backports (merged mode's 32x8x128 wave:
    # 3.48 s, of which decode ~0.74 s): the server processes' CPU seconds per way, and py-spy samples of each
    # during the bare client's waves (py-spy comes with SGLang's kit).
    probe-costs-http) cmd=(env PATH="$PATH:/tmp/site/bin" "${probe[@]}" --model "$rmodel" "${kernels[@]}"
                           --ways raw raw-nologprobs gateway-share --profile-way raw
                           --profile-dir "$OUT/probe-costs-http-profile"
                           --json "$results/probe_costs_http-${rmodel##*/}.json") ;;
    probe-costs-vllm) cmd=("${probe[@]}" --engine vllm "${vllm_kernels[@]}" --ways art-client raw
                           --json "$results/probe_costs_vllm-${big##*/}.json") ;;
    bench-rollouts-sglang) cmd=("${rollouts[@]}" --side backend "${kernels[@]}" --workdir "/tmp/work-$name"
                                --json "$results/bench_rollouts-sglang-${big##*/}.json") ;;
    bench-rollouts-vllm) cmd=("${rollouts[@]}" --side direct --engine vllm "${vllm_kernels[@]}" --workdir "/tmp/work-$name"
                              --json "$results/bench_rollouts-vllm-${big##*/}.json") ;;
    # One serving flag against the defaults, each on its own server: 384-token answers (where decoding
    # dominates and the backend trailed vLLM) and 128-token ones, 32 groups of 8.
    flags-*) cmd=(python3 scripts/bench_rollouts.py --model "$big" "${kernels[@]}" --side backend --clients art
                  --runs grpo-384:32 grpo-128:32 --ttft-requests 0 --workdir "/tmp/work-$name"
                  --json "$results/$name.json")
             case ${name#flags-} in
               default) ;;
               all-modules) cmd+=(--lora-target-modules all) ;;
               chunk-128) cmd+=(--sglang-args='--max-lora-chunk-size 128') ;;
               no-overlap) cmd+=(--sglang-args='--disable-overlap-schedule') ;;
               *) echo "unknown flag variant $name" >&2; failed=$((failed + 1)); continue ;;
             esac ;;
    bench-rollouts) cmd=(python3 scripts/bench_rollouts.py --compare "$results/bench_rollouts-sglang-${big##*/}.json"
                         "$results/bench_rollouts-vllm-${big##*/}.json" --json "$results/bench_rollouts-${big##*/}.json"
                         --markdown "$results/bench_rollouts-${big##*/}.md") ;;
    models-7b) cmd=(python3 tests/gpu/gpu_models.py /root/models qwen2.5-7b-shape) ;;
    models-random) cmd=(python3 tests/gpu/gpu_models.py /root/models qwen2.5-1.5b-random) ;;
    models-random-7b) cmd=(python3 tests/gpu/gpu_models.py /root/models qwen2.5-7b-random) ;;
    # Issue 39: a LoRA serving change's logprobs against a baseline's, 200 requests at once (decode in the CUDA
    # graphs): SGLang started twice as the backend launches it, same adapter, greedy decode and teacher-forced
    # prefill. Each side's LoRA kernels are SGLangConfig settings, as a user sets them: VARIANT_LORA (default the
    # triton path, the default's) and BASELINE_LORA (default csgmv, SGLang's own); VARIANT_ENV / BASELINE_ENV
    # (KEY=VALUE ...) and VARIANT_ARGS / BASELINE_ARGS (SGLang flags) change one side further. PROMPT_TOKENS
    # (default 64; 256 keeps the prefill chunks under the triton backend's 32-request graph cap).
    lora-logprob-ab)
      # shellcheck disable=SC2206
      cmd=(python3 scripts/lora_logprob_ab.py --model "$rmodel" "${kernels[@]}" --workdir "$work"
           ${VARIANT_LORA-${triton_lora[*]}} --variant-env ${VARIANT_ENV:-} --variant-args="${VARIANT_ARGS:-}"
           ${BASELINE_LORA---baseline-lora-backend csgmv --no-baseline-lora-experimental-path}
           --baseline-env ${BASELINE_ENV:-} --baseline-args="${BASELINE_ARGS:-}"
           --prompt-tokens "${PROMPT_TOKENS:-64}" --json "$results/$run_name.json") ;;
    r39-compare) cmd=(python3 scripts/bench_rollouts.py --compare "$results"/r39-*-"${rmodel##*/}".json
                      --json "$results/bench_rollouts39-${rmodel##*/}.json"
                      --markdown "$results/bench_rollouts39-${rmodel##*/}.md") ;;
    r39-*)
      # shellcheck disable=SC2206
      case ${name#r39-} in
        backend-a1) cmd=("${r39[@]}" --side backend --label A1 "${kernels[@]}" --runs $r39_main) ;;
        vllm) cmd=("${r39[@]}" --side direct --engine vllm "${vllm_kernels[@]}" --runs $r39_main) ;;
        backend-merged) cmd=("${r39[@]}" --side backend --weights merged "${kernels[@]}"
                             --runs grpo-128:32 grpo-128:16 grpo-1024:16@bare) ;;
        # The server inherits ART_SGLANG_BACKPORTS: the default backports but the memo.
        backend-merged-no-memo)
          cmd=(env "ART_SGLANG_BACKPORTS=$(backports_without chat-template-memo)" "${r39[@]}" --side backend
               --weights merged --label "no memo" "${kernels[@]}" --runs grpo-128:32 grpo-128:16 grpo-1024:16@bare) ;;
        # The backend with the triton LoRA path asked for by name (the default since 2026-11-28, as a1's).
        backend-triton) cmd=("${r39[@]}" --side backend "${kernels[@]}" "${triton_lora[@]}" --runs $r39_main) ;;
        backend-a2) cmd=("${r39[@]}" --side backend --label A2 "${kernels[@]}" --routes gateway server
                         --clients bare --runs $r39_split) ;;
        vllm-base) cmd=("${r39[@]}" --side direct --engine vllm --no-lora "${vllm_kernels[@]}" --clients bare
                        --runs grpo-128:32 grpo-128:16 grpo-1024:16) ;;
        direct-exact) cmd=("${r39[@]}" --side direct --flags backend --request-form gateway "${kernels[@]}"
                           --clients bare --runs $r39_split) ;;
        direct-triton) cmd=("${r39[@]}" --side direct --flags backend --request-form gateway "${kernels[@]}"
                            "${triton_lora[@]}" --clients bare --runs $r39_split) ;;
        drop-*) cmd=("${r39[@]}" --side direct --flags backend --drop "${name#r39-drop-}" --request-form gateway
                     "${kernels[@]}" --clients bare --runs $r39_split) ;;
        # Where a wave's time goes outside decode (SGLang 0.5.17's one HTTP process encoded each non-streamed
        # chat response with FastAPI's jsonable_encoder, ~47 ms per 1,024-token answer, until the backports): the
        # same launch with 4 tokenizer/HTTP workers (0.5.17 refuses them beside an API key, hence no keys;
        # compare with r39-drop-keys), and with mixed chunks (admission prefills beside decode).
        http-workers) cmd=("${r39[@]}" --deadline-s 330 --side direct --flags backend --drop keys --request-form gateway
                           "${kernels[@]}" --sglang-args="--tokenizer-worker-num 4" --clients bare --runs $r39_split) ;;
        mixed-chunk) cmd=("${r39[@]}" --deadline-s 330 --side direct --flags backend --request-form gateway "${kernels[@]}"
                          --sglang-args="--enable-mixed-chunk" --clients bare --runs $r39_split) ;;
        # Item 3: one LoRA serving flag added last to the backend's launch on its previous default LoRA path, the
        # one these were measured against (SGLang's parser keeps an option's last value); no run starts after
        # 330 s (the later --deadline-s wins), so 4 fit on 4 GPUs in one call.
        # SGLang 0.5.17's LoRA kernels cost it 39-46 % of its decode rate (its log, 2026-11-28):
        # the triton backend, alone and with 0.5.17's experimental path behind environment variables (each
        # shrink on a second stream beside the base GEMM, down_proj's shrink split; the second variable keeps
        # it right under CUDA graphs; the third shrinks by cuBLAS where one adapter is resident). The server
        # inherits the bench's environment.
        lora-*)
          envs=()
          case ${name#r39-lora-} in
            triton) change='--lora-backend triton' ;;
            triton-loras-1) change='--lora-backend triton --max-loras-per-batch 1' ;;
            exp-opti) change='--lora-backend triton' envs=("${exp_opti[@]}") ;;
            exp-cublas) change='--lora-backend triton --max-loras-per-batch 1'
                        envs=("${exp_opti[@]}" SGLANG_OPT_LORA_CUBLAS=1) ;;
            rank-64) change='--max-lora-rank 64' ;;
            no-prefill-graph) change='--disable-prefill-cuda-graph' ;;
            loras-2) change='--max-loras-per-batch 2' ;;
            # exp-opti's prefill eager (grids from the live batch) rather than through the default
            # triton-prefill-grid backport's 16-row segments.
            exp-opti-eager-prefill) change='--lora-backend triton --disable-prefill-cuda-graph'
                                    envs=("${exp_opti[@]}") ;;
            *) echo "unknown suite $name" >&2; failed=$((failed + 1)); continue ;;
          esac
          cmd=(env "${envs[@]}" "${r39[@]}" --deadline-s 330 --side direct --flags backend
               --request-form gateway "${kernels[@]}" --sglang-args="$change" --clients bare
               --runs $r39_split) ;;
        *) echo "unknown suite $name" >&2; failed=$((failed + 1)); continue ;;
      esac
      # shellcheck disable=SC2206
      [ -z "${RUNS:-}" ] || cmd+=(--runs $RUNS)
      cmd+=(--workdir "$work" --json "$results/$run_name.json") ;;
    stall-*)
      case ${name#stall-} in
        backend) cmd=("${r39[@]}" --side backend --label stall "${kernels[@]}" "${stall[@]}") ;;
        no-watchdog) cmd=("${r39[@]}" --side backend --label stall --no-watchdog "${kernels[@]}" "${stall[@]}") ;;
        # The backend with its eviction as SGLang 0.5.17 released it (both eviction backports off), or with one
        # of the two only: what each does alone.
        released-eviction | only-evict-without-gc | only-evict-ahead)
          case ${name#stall-} in
            released-eviction) off=evict-without-gc,evict-ahead ;;
            only-evict-without-gc) off=evict-ahead ;;
            *) off=evict-without-gc ;;
          esac
          cmd=(env "ART_SGLANG_BACKPORTS=$(backports_without "$off")" "${r39[@]}" --side backend
               --label "${name#stall-}" "${kernels[@]}" "${stall[@]}") ;;
        direct) cmd=("${r39[@]}" --side direct --flags backend --request-form gateway "${kernels[@]}" "${stall[@]}") ;;
        direct-trainer) cmd=("${r39[@]}" --side direct --flags backend --request-form gateway --beside-trainer
                             "${kernels[@]}" "${stall[@]}") ;;
        *) echo "unknown suite $name" >&2; failed=$((failed + 1)); continue ;;
      esac
      # py-spy (SGLang's kit has it) samples the server's processes over the first 1,024-token run's 30 s.
      cmd=(env PATH="$PATH:/tmp/site/bin" "${cmd[@]}" --profile-dir "$OUT/$name-profile"
           --workdir "$work" --json "$results/$run_name.json") ;;
    bench-trainer) cmd=(python3 scripts/bench_trainer.py --model "$big" --out "$OUT") ;;
    # 512 conversations with CUDA graphs on: at 128 without graphs (the first H200x2 run) one replica was
    # not saturated, so a second could not double the throughput.
    bench-replicas) cmd=(python3 scripts/bench_replicas.py --model "$big" "${kernels[@]}" --conversations 512
                         --workdir /tmp/bench-replicas
                         --json "$results/bench_replicas.json" --markdown "$results/bench_replicas.md") ;;
    bench-trainer-ddp) cmd=(python3 scripts/bench_trainer.py --model "$big" --backends unsloth --ranks 1,2
                            --batch 32 --seq 1024 --packings default,16384 --micro-batch-tokens 8192 --steps 3
                            --name bench_trainer_ddp --work /tmp/bench-trainer-ddp --out "$results") ;;
    bench-multiturn) cmd=(python3 scripts/bench_multiturn.py --model "$big" "${kernels[@]}"
                          --json "$results/bench_multiturn.json" --markdown "$results/bench_multiturn.md") ;;
    bench-pipeline-1gpu) cmd=("${pipeline[@]}" --layout co_resident --json "$pipe_out.json"
                               --markdown "$pipe_out.md") ;;
    bench-pipeline-1gpu-no-mps) cmd=("${pipeline[@]}" --layout co_resident --cuda-mps off
                                      --json "$pipe_out.json"
                                      --markdown "$pipe_out.md") ;;
    # Issue 40: the same two layouts serving merged weights (compare with bench-pipeline-1gpu / -split).
    bench-pipeline-1gpu-merged) cmd=("${pipeline[@]}" --layout co_resident --weights merged
                                      --json "$pipe_out.json"
                                      --markdown "$pipe_out.md") ;;
    bench-pipeline-split-merged) cmd=("${pipeline[@]}" --layout split --weights merged
                                       --json "$pipe_out.json"
                                       --markdown "$pipe_out.md") ;;
    bench-pipeline-split) cmd=("${pipeline[@]}" --layout split --json "$pipe_out.json"
                                --markdown "$pipe_out.md") ;;
    bench-pipeline-replicas) cmd=("${pipeline[@]}" --layout replicas --json "$pipe_out.json"
                                   --markdown "$pipe_out.md") ;;
    bench-pipeline-four-gpu) cmd=("${pipeline[@]}" --layout four_gpu --json "$pipe_out.json"
                                   --markdown "$pipe_out.md") ;;
    four-gpu) cmd=("${pytest[@]}" -m gpu tests/gpu/test_four_gpus.py) ;;
    four-gpu-7b) cmd=(env ART_SGLANG_GPU_FOUR_MODEL=/root/models/qwen2.5-7b-shape "${pytest[@]}" -m gpu
                      tests/gpu/test_four_gpus.py) ;;
    # Rows of 24 sequences (2 per step): 12 per rank on 2, 8 on 3, so a rank's share is never the cap; ART's
    # default rows (2048 tokens: 2 of these sequences) bound any rank count at 2x (bench-trainer-ddp has them).
    # TORCH_LOGS=recompiles: the trainer logs (collected below) say whether a rank count meets more compiled
    # shapes than the compiler keeps.
    bench-trainer-ddp3) cmd=(env TORCH_LOGS=recompiles python3 scripts/bench_trainer.py --model "$tmodel" --backends unsloth
                             --ranks 1,2,3 --batch 48 --seq 1024 --packings 24576 --micro-batch-tokens 8192 --steps 3
                             --name bench_trainer_ddp3 --work "/tmp/work-$name" --out "$results") ;;
    bench-trainer-ddp3-mb24k) cmd=(env TORCH_LOGS=recompiles python3 scripts/bench_trainer.py --model "$tmodel" --backends unsloth
                             --ranks 1,2,3 --batch 48 --seq 1024 --packings 24576 --micro-batch-tokens 24576 --steps 3
                             --name bench_trainer_ddp3_mb24k --work "/tmp/work-$name" --out "$results") ;;
    # 5 s idle before each timed step, as a synchronous loop's rollouts: rank 0's background optimizer-state
    # write of the step before is then done (is it what makes rank 0 the slowest rank?).
    bench-trainer-ddp3-gap) cmd=(python3 scripts/bench_trainer.py --model "$tmodel" --backends unsloth --ranks 1,2,3
                             --batch 48 --seq 1024 --packings 24576 --micro-batch-tokens 8192 --steps 3 --gap-s 5
                             --name bench_trainer_ddp3_gap --work "/tmp/work-$name" --out "$results") ;;
    bench-trainer-ddp3-b192) cmd=(env TORCH_LOGS=recompiles python3 scripts/bench_trainer.py --model "$tmodel" --backends unsloth
                             --ranks 1,2,3 --batch 192 --seq 1024 --packings 24576 --micro-batch-tokens 8192 --steps 2
                             --name bench_trainer_ddp3_b192 --work "/tmp/work-$name" --out "$results") ;;
    # Most of a micro-batch's fixed cost sits in Unsloth's checkpointed backward (py-spy, 2026-11-27): without
    # gradient checkpointing a backward no longer runs the forward again.
    bench-trainer-ddp3-nockpt) cmd=(python3 scripts/bench_trainer.py --model "$tmodel" --backends unsloth --ranks 1,2,3
                             --batch 48 --seq 1024 --packings 24576 --micro-batch-tokens 8192 --steps 3
                             --gradient-checkpointing off --name bench_trainer_ddp3_nockpt --work "/tmp/work-$name"
                             --out "$results") ;;
    bench-trainer-ddp3-nockpt-mb24k) cmd=(python3 scripts/bench_trainer.py --model "$tmodel" --backends unsloth
                             --ranks 1,2,3 --batch 48 --seq 1024 --packings 24576 --micro-batch-tokens 24576 --steps 3
                             --gradient-checkpointing off --name bench_trainer_ddp3_nockpt_mb24k
                             --work "/tmp/work-$name" --out "$results") ;;
    # A CUDA timeline of one rank's 3rd step (after the warm-up) at each rank count: is a micro-batch's fixed cost
    # the GPU's or the launches'? (train3-rank*-busy.json: kernel time against wall time)
    bench-trainer-ddp3-profile) cmd=(env ART_SGLANG_TRAINER_PROFILE="$OUT/trainer-profile-$name" python3
                             scripts/bench_trainer.py --model "$tmodel" --backends unsloth --ranks 1,3 --batch 48 --seq 1024
                             --packings 24576 --micro-batch-tokens 8192 --steps 2 --name bench_trainer_ddp3_profile
                             --work "/tmp/work-$name" --out "$results") ;;
    loss-curves-3) cmd=(python3 scripts/loss_curves.py --model "$big" --runs 1,1,3 --steps 8 --name loss_curves_3
                        --work "/tmp/work-$name" --out "$results") ;;
    *) echo "unknown suite $name" >&2; failed=$((failed + 1)); continue ;;
  esac
  # Each pytest suite keeps its own temporary folder, so several suites can run at once (device/per_gpu.sh) and
  # the servers' logs can be collected by suite.
  if [[ " ${cmd[*]} " == *" pytest "* ]]; then rm -rf "/tmp/pt-$name"; cmd+=(--basetemp "/tmp/pt-$name"); fi
  # ... and each pipeline bench its own work folder, so its trainer and server logs are collected too.
  if [[ $name == bench-pipeline-* ]]; then cmd+=(--workdir "/tmp/work-$name${TAG:+-$TAG}"); fi
  echo "=== $name: ${cmd[*]}" | tee "$OUT/$name.log"
  pmon=
  if [[ $name == stall-* ]] && command -v nvidia-smi > /dev/null; then  # which processes use the GPU, each second
    nvidia-smi pmon -i "${CUDA_VISIBLE_DEVICES:-0}" -s u -d 1 > "$OUT/$name-pmon.txt" 2>&1 &
    pmon=$!
  fi
  "${cmd[@]}" 2>&1 | tee -a "$OUT/$name.log" | grep -E --line-buffered '^(===|PASSED|FAILED|ERROR|SKIPPED)|passed|failed|error|\| '
  rc=${PIPESTATUS[0]}
  [ -z "$pmon" ] || kill "$pmon"
  if [[ $name == r39-* || $name == stall-* ]] && [ -d "$work" ]; then
    find "$work" -name 'server*.log' -exec python3 scripts/decode_stalls.py {} + 2>&1 \
      | sed 's/^/=== stalls: /' | tee -a "$OUT/$name.log"
  fi
  echo "=== $name: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/$name.log"
  for log in $(find "/tmp/pt-$name" "/tmp/work-$name" "$work" \( -name 'server*.log' -o -name 'trainer*.log' \) -size -4M 2>/dev/null); do
    mkdir -p "$OUT/$name-logs" && cp "$log" "$OUT/$name-logs/$(echo "${log#/tmp/}" | tr / _)"
  done
  [ "$rc" = 0 ] || failed=$((failed + 1))
done
cp -r "$results"/. "$OUT/"
exit "$failed"
