"""What the recording scheduler costs vLLM: output tokens/s of one workload with vLLM's own scheduler
and with integrations.vllm.RecordingScheduler (its records read by a client, as attach mode does).

Runs in the vLLM environment (scripts/install_vllm.sh), from the repository root:
    .venv-vllm/bin/python -m demos.vllm.recorder_cost --model FOLDER [--requests 8 --prompt 256 --output 64]
    .venv-vllm/bin/python -m demos.vllm.recorder_cost --model FOLDER --hooks     # the recorder's cost per step alone

Each side runs in its own process (vLLM's scheduler class is fixed when its engine starts), one after
the other, with the same prompts (fixed lengths, ignore_eos: every request gives exactly --output tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

# vLLM's CPU build: 2 GiB of KV cache, loopback only, compute on every core (docs/vllm.md); the
# environment's own values win
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def one(args) -> dict:
    """One side, in this process: load, warm up, time the workload."""
    from vllm import LLM, SamplingParams
    kwargs = {"scheduler_cls": "integrations.vllm.RecordingScheduler"} if args.recorder else {}
    llm = LLM(model=args.model, dtype="float32", max_model_len=4096, max_num_batched_tokens=args.budget,
              max_num_seqs=args.requests, seed=0, optimization_level=args.opt, **kwargs)
    lines = {"records": 0}
    if args.recorder:
        threading.Thread(target=read_records, args=(int(os.environ["BATCHSCOPE_RECORDS_PORT"]), lines),
                         daemon=True).start()
    sp = SamplingParams(max_tokens=args.output, ignore_eos=True, temperature=0)
    prompts = [{"prompt_token_ids": [(i * 7919 + j) % 30000 + 10 for j in range(args.prompt)]}
               for i in range(args.requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)      # warm up
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    time.sleep(0.5)
    return {"recorder": args.recorder, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "records_read": lines["records"]}


def hook_cost(model: str, steps: int = 3000, rounds: int = 5) -> dict:
    """Microseconds per step that the recording adds to vLLM's scheduler alone, with no model behind it
    (the same requests decoding, driven as the engine core drives it: schedule, then update_from_output),
    plain and recording scheduler taking turns. Compared with a real step's time, it is the recorder's
    share of vLLM's step loop, free of the machine's drift between two separate server runs."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams as SP
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from integrations.vllm import RecordingScheduler
    os.environ.setdefault("BATCHSCOPE_RECORDS_PORT", "0")    # a real socket, with a reader (below)
    init_none_hash(sha256)
    vc = VllmConfig(model_config=ModelConfig(model=model, dtype="float32", skip_tokenizer_init=True,
                                             max_model_len=4096),
                    scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=4096,
                                                     is_encoder_decoder=False),
                    cache_config=CacheConfig(block_size=16, enable_prefix_caching=True))
    vc.cache_config.num_gpu_blocks = 2000
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=2000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    hasher = get_request_block_hasher(16, sha256)

    def per_step(cls) -> float:
        sched = cls(vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
                    block_size=16, log_stats=True)
        pub = getattr(sched, "publisher", None)
        if pub is not None:
            threading.Thread(target=read_records, args=(pub.port, {"records": 0}), daemon=True).start()
        for i in range(8):
            sched.add_request(Request(f"chatcmpl-u{i}-0000000{i}", [100 + i] * 200, SP(max_tokens=10**6,
                                      ignore_eos=True), None, block_hasher=hasher))
        t = time.perf_counter()
        for _ in range(steps):
            out = sched.schedule()
            ids = list(out.num_scheduled_tokens)
            sched.update_from_output(out, ModelRunnerOutput(req_ids=ids,
                                                            req_id_to_index={r: k for k, r in enumerate(ids)},
                                                            sampled_token_ids=[[5] for _ in ids]))
        seconds = (time.perf_counter() - t) / steps
        if pub is not None:
            pub.close()
        return seconds

    plain, rec = [], []
    for _ in range(rounds):
        plain.append(per_step(Scheduler))
        rec.append(per_step(RecordingScheduler))
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return {"plain_us_per_step": med(plain) * 1e6, "recording_us_per_step": med(rec) * 1e6,
            "added_us_per_step": (med(rec) - med(plain)) * 1e6}


def read_records(port: int, lines: dict):
    for _ in range(600):
        try:
            sock = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            time.sleep(0.1)
    for _ in sock.makefile("rb"):
        lines["records"] += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.vllm.recorder_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="local model folder vLLM can load")
    ap.add_argument("--requests", type=int, default=8, help="requests, all at once (also max_num_seqs)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--hooks", action="store_true", help="only the model-free cost of the recording per step")
    ap.add_argument("--opt", type=int, default=0, help="vLLM's -O level (0: no compile, starts in a minute)")
    ap.add_argument("--recorder", action="store_true", help=argparse.SUPPRESS)     # one side, in this process
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    if args.hooks:
        cost = hook_cost(args.model)
        print(f"scheduler alone {cost['plain_us_per_step']:.0f} us/step, recording {cost['recording_us_per_step']:.0f} "
              f"us/step: the recorder adds {cost['added_us_per_step']:.0f} us per step (8 decoding requests; "
              f"load {os.getloadavg()[0]:.1f})")
        return
    rows = []
    for recorder in (False, True):
        env = {**CPU_ENV, **os.environ, "BATCHSCOPE_RECORDS_PORT": str(free_port()), "PYTHONPATH": os.getcwd()}
        cmd = [sys.executable, "-m", "demos.vllm.recorder_cost", "--one", "--model", args.model, "--requests",
               str(args.requests), "--prompt", str(args.prompt), "--output", str(args.output), "--budget",
               str(args.budget), "--opt", str(args.opt)] + (["--recorder"] if recorder else [])
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if run.returncode or not result:
            sys.exit(f"the {'recording' if recorder else 'plain'} run failed:\n{run.stderr[-3000:]}")
        rows.append(json.loads(result[0][7:]))
    plain, rec = rows
    for r in rows:
        print(f"{'recording' if r['recorder'] else 'vLLM alone':<11} {r['tokens_per_s']:8.1f} tok/s "
              f"({r['tokens']} tokens in {r['seconds']:.1f} s; {r['records_read']} records read)")
    print(f"recording / alone: {rec['tokens_per_s'] / plain['tokens_per_s']:.3f}  (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
