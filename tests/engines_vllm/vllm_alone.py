"""vLLM alone, the tests' independent reference: greedy token ids for prompt ids, from vLLM's own
`LLM` with the options a tokenmill vLLM worker gives it (run with vLLM's venv's interpreter).

    python vllm_alone.py OUT.json < {"model": DIR, "prompts": [[ids]...], "max_tokens": N, ...}
    -> OUT.json: {"outputs": [[ids]...]}   (stdout is vLLM's log)
"""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    job = json.load(sys.stdin)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.dirname(os.path.abspath(sys.argv[1])))  # not /tmp
    # the engine core in this process: a reference run then imports vLLM once, not three times
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, block_size=job["block_size"],
              max_model_len=job["max_model_len"], seed=0)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
    with open(sys.argv[1], "w", encoding="utf-8") as out_file:
        json.dump({"outputs": [list(out.outputs[0].token_ids) for out in outputs]}, out_file)


if __name__ == "__main__":
    main()
